"""Alignment strategies; each returns one map per space of model B in A's basis."""

from .weight_matching import weight_matching

__all__ = ["weight_matching"]
