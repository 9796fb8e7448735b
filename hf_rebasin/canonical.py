"""Canonical form for orthogonal residual maps (Theus et al.).

Orthogonal maps do not commute with a norm's per-feature scale γ, nor with LayerNorm's mean
subtraction unless they fix the all-ones vector. So, for every space that admits orthogonal maps:
fold each norm's γ (and β, where every reader has a bias) into the linear layers that read it, and
for LayerNorm also center every writer of the stream (its mean is invisible to every reader).
The result computes the same function with standard modules (γ = 1); a tie between a reader and a
writer (LM head and embeddings) breaks and is untied. Pure tensor code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from .errors import TransformError
from .symmetry import Fused, Space, SymmetryGraph


def _axis_of(graph: SymmetryGraph, tensor: str, space: str) -> int:
    for axis, ref in enumerate(graph.bindings[tensor].axes):
        if ref == space:
            return axis
    raise AssertionError(f"{tensor} is not bound to {space}")  # adapter bug, caught by tests


def bias_of(weight: str, state_dict: Mapping[str, Tensor]) -> str | None:
    if weight.endswith(".weight"):
        bias = weight[: -len(".weight")] + ".bias"
        if bias in state_dict:
            return bias
    return None


def is_canonical(graph: SymmetryGraph, state_dict: Mapping[str, Tensor]) -> bool:
    """True when every foldable norm of an orthogonal-capable space has γ = 1."""
    for norm in graph.norms:
        space = graph.spaces.get(norm.space)
        if isinstance(space, Space) and space.max_class == "orthogonal" and norm.readers:
            if not torch.all(state_dict[norm.weight] == 1):
                return False
    return True


def canonicalize(
    graph: SymmetryGraph, state_dict: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], SymmetryGraph, list[str]]:
    """Return ``(state_dict, graph, untied)``: an equivalent state dict in canonical form, the graph
    with broken ties removed, and the tied aliases that had to be untied."""
    sd = dict(state_dict)
    spaces = [n for n, s in graph.spaces.items() if isinstance(s, Space) and s.max_class == "orthogonal"]
    norm_params = {p for n in graph.norms for p in (n.weight, n.bias) if p is not None}
    touched: set[str] = set()
    for name in spaces:
        norms = [n for n in graph.norms if n.space == name and n.readers]
        readers = {r for n in norms for r in n.readers}
        for norm in norms:
            gamma = sd[norm.weight].to(torch.float64)
            beta = sd[norm.bias].to(torch.float64) if norm.bias else None
            biases = [bias_of(r, sd) for r in norm.readers]
            fold_beta = beta is not None and all(b is not None for b in biases)
            for reader, bias in zip(norm.readers, biases, strict=False):
                w = sd[reader]
                axis = _axis_of(graph, reader, name)
                if fold_beta and bias is not None:
                    shift = torch.tensordot(w.to(torch.float64), beta, dims=([axis], [0]))
                    sd[bias] = (sd[bias].to(torch.float64) + shift).to(sd[bias].dtype)
                    touched.add(bias)
                shape = [1] * w.dim()
                shape[axis] = -1
                # one product per weight, rounded once: in w's dtype when γ is exact in it (the usual
                # case), which gives the same bits as a float64 product without a float64 copy of w
                g = gamma.to(w.dtype)
                scaled = (
                    w * g.reshape(shape)
                    if torch.equal(g.to(torch.float64), gamma)
                    else w.double() * gamma.reshape(shape)
                )
                sd[reader] = scaled.to(w.dtype)
                touched.add(reader)
            sd[norm.weight] = torch.ones_like(sd[norm.weight])
            if fold_beta and norm.bias is not None:
                sd[norm.bias] = torch.zeros_like(sd[norm.bias])
            elif beta is not None and norm.bias is not None:
                # β stays in the norm (a reader has no bias): the reader now scales by γ, so β/γ
                if gamma.abs().min() < 1e-8:
                    raise TransformError(
                        f"norm scale {norm.weight!r} has a zero entry and its readers have no bias, "
                        "so its shift cannot be folded; use `class: permutation` for this model"
                    )
                sd[norm.bias] = (beta / gamma).to(sd[norm.bias].dtype)
        space = graph.spaces[name]
        if isinstance(space, Space) and space.centered:
            for tensor, axis, _role, _off in graph.users(name):
                if tensor in readers or tensor in norm_params:
                    continue
                ref = graph.bindings[tensor].axes[axis]
                if isinstance(ref, Fused):
                    raise AssertionError(f"writer {tensor} has a fused residual axis")
                t = sd[tensor]
                t64 = t.to(torch.float64)
                sd[tensor] = (t64 - t64.mean(dim=axis, keepdim=True)).to(t.dtype)
                touched.add(tensor)
    # a touched tensor is a new object, so an untied alias already has storage of its own
    untied = [alias for alias, source in graph.ties.items() if alias in touched or source in touched]
    ties = {a: s for a, s in graph.ties.items() if a not in untied}
    return sd, dataclasses.replace(graph, ties=ties), untied
