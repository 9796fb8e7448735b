"""The models of a run by role, never by list position.

A merge or barrier has a reference A and the models aligned to it (B, C, …). A transport has a
target B (the reference: the old base is aligned to it), the old base A and the fine-tune A + τ.
The letters mean the same thing everywhere: A is what B is aligned to in a merge, the old base in a
transport. The same containers hold recipe references, resolved folders and loaded models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, Union

__all__ = ["TRANSPORT_ROLES", "MergeRoles", "Roles", "TransportRoles", "letter"]

T = TypeVar("T")
U = TypeVar("U")

TRANSPORT_ROLES = ("target", "base", "finetuned")  # the recipe's fields, in the order of `Recipe.refs`


def letter(i: int) -> str:
    """A model's name in notes and records: A (the reference), B, C, …"""
    return chr(ord("A") + i) if i < 26 else f"#{i + 1}"


@dataclass(frozen=True)
class MergeRoles(Generic[T]):
    """merge / barrier: the reference A, and the others (B, C, …) aligned to it."""

    reference: T
    others: tuple[T, ...]

    @property
    def all(self) -> tuple[T, ...]:
        """Every model, A first (the order of ``models`` in the recipe)."""
        return (self.reference, *self.others)

    @property
    def names(self) -> tuple[str, ...]:
        """The models' letters: A, B, C, …"""
        return tuple(letter(i) for i in range(len(self.all)))

    @property
    def labels(self) -> tuple[str, ...]:
        """How the dry-run plan names each model: ``A (reference)``, B, C, …"""
        return ("A (reference)", *self.names[1:])

    def map(self, f: Callable[[T], U]) -> MergeRoles[U]:
        """The same roles holding ``f`` of each value (references → resolved → loaded models)."""
        return MergeRoles(f(self.reference), tuple(f(x) for x in self.others))


@dataclass(frozen=True)
class TransportRoles(Generic[T]):
    """transport: the target B (the reference), the old base A aligned to it, the fine-tune A + τ."""

    target: T
    base: T
    finetune: T

    @property
    def all(self) -> tuple[T, ...]:
        """target, base, fine-tune: the order of `Recipe.refs` (the reference first)."""
        return (self.target, self.base, self.finetune)

    @property
    def names(self) -> tuple[str, ...]:
        """The recipe's field names, as records and notes call the models."""
        return TRANSPORT_ROLES

    @property
    def reference(self) -> T:
        """The model every other is compared with: the target."""
        return self.target

    @property
    def labels(self) -> tuple[str, ...]:
        """How the dry-run plan names each model, in the order of ``all``."""
        return ("target B (reference)", "base A", "fine-tune A + τ")

    def map(self, f: Callable[[T], U]) -> TransportRoles[U]:
        """The same roles holding ``f`` of each value, called in the recipe's order."""
        return TransportRoles(f(self.target), f(self.base), f(self.finetune))


Roles = Union[MergeRoles[T], TransportRoles[T]]  # noqa: UP007  (a generic alias: `|` cannot be subscripted on 3.10)
