"""Engines: optimisation machinery that strategies share, not strategies themselves.

A strategy (a registry entry and its ``run``) decides *what* to match; an engine is *how* a kind
of matching is solved, used by several strategies or by the universe merge:

* `descent`: coordinate descent over the symmetry graph's spaces (LAP, Procrustes, per-head
  circuits, per-sublayer residual maps), the data-free core of weight-matching, transfusion,
  head-perm's head solver and generalized-orthogonal;
* `invertible`: least-squares invertible maps inside attention heads (``inner: invertible``);
* `learned`: learned matching, maps refined by gradient on the loss of interpolated or merged
  models (``learned: true``, and the universe merge's multi-model refinement).

Engines import torch; nothing here is registered or named by a recipe.
"""
