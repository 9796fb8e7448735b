"""Checks the adapter tests share: how far a rebuilt model's outputs move, and a random permutation
of one space (the negative controls of each family's test file are built from these)."""

from __future__ import annotations

import torch

from hf_rebasin.alignment.strategies import Alignment, AlignmentData, Pair, align
from hf_rebasin.alignment.verify import compare, example_inputs, outputs_of
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import get_adapter, graph_for
from hf_rebasin.symmetry.graph import SymmetryGraph
from hf_rebasin.symmetry.transforms import AxisMap, Transform


def output_gap(model: torch.nn.Module, graph: SymmetryGraph, sd: dict[str, torch.Tensor], t: Transform) -> float:
    """max |Δ| of every output of the stock ``model`` rebuilt from ``sd`` (hidden states mapped by ``t``)."""
    spec = get_adapter(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model.eval(), spec, inputs)
    after = outputs_of(rebuild(model, sd), spec, inputs)
    return compare(spec, graph, t, before, after)


def permuted(graph: SymmetryGraph, space: str, seed: int = 0) -> Transform:
    """The identity of ``graph`` with ``space`` permuted at random."""
    t = graph.identity()
    n = graph.spaces[space].size
    t[space] = AxisMap(n, index=torch.randperm(n, generator=torch.Generator().manual_seed(seed)))
    return t


def planted_by_activations(model: torch.nn.Module, residual: str, seed: int) -> tuple[Alignment, float]:
    """Head-perm on ``model`` against itself under a random permutation (seeded), on four batches of
    the family's example inputs: the alignment, and max |Δ| of its aligned B from ``model``'s weights."""
    model = model.eval()
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    sd_b = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(seed)))
    spec = get_adapter(model.config.model_type)
    batches = [example_inputs(spec, model.config, torch.Generator().manual_seed(i)) for i in range(4)]
    pair = Pair(graph, sd, sd_b, model, rebuild(model, sd_b), AlignmentData(batches, frozenset({0})))
    alignment = align("head-perm", pair, {"residual": residual})
    aligned = alignment.aligned_b()
    return alignment, max((aligned[k] - sd[k]).abs().max().item() for k in sd)
