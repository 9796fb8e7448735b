"""Decoders mergekit merges (Granite, StarCoder2, StableLM, Phi): what is particular to each family.
`test_adapters` proves every allowed transform on their tiny models; here the family's own
constraints are shown to be real (a forbidden map moves the logits) and its extras to be active."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import tiny
from hf_rebasin.alignment.verify import TOLERANCE, example_inputs, outputs_of, verify_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY, graph_for
from hf_rebasin.symmetry.canonical import canonicalize
from hf_rebasin.symmetry.transforms import AxisMap, random_orthogonal


def _logits(model: torch.nn.Module, seed: int = 7) -> torch.Tensor:
    spec = REGISTRY.get(model.config.model_type)
    return outputs_of(model, spec, example_inputs(spec, model.config, torch.Generator().manual_seed(seed)))["logits"]


def _gap(model: torch.nn.Module, sd: dict[str, torch.Tensor], untie: bool = False) -> float:
    """max |Δ logits| of ``model`` rewritten with ``sd``."""
    return float((_logits(rebuild(model, sd, untie=untie)) - _logits(model)).abs().max())


def _rotate_stream(model: torch.nn.Module, fix_ones: bool, seed: int = 1) -> float:
    """max |Δ logits| after a random rotation of the canonical stream (fixing 1 or not)."""
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    t = graph.identity()
    size = graph.spaces["res"].size
    blocks = random_orthogonal(size, torch.Generator().manual_seed(seed), fix_ones=fix_ones)[None]
    t["res"] = AxisMap(size, blocks=blocks)
    return _gap(model, graph.apply(sd, t, check=False), untie=bool(untied))


# ---------------------------------------------------------------------------------------------
# Granite: four scalar multipliers


def test_granite_multipliers_are_active_and_commute_with_rotations():
    """The tiny Granite's multipliers change its function (the same weights with all four at 1 give
    other logits), and a random orthogonal transform of it keeps the logits all the same."""
    model = tiny.FACTORIES["granite"](0)
    assert all(getattr(model.config, k) == v != 1.0 for k, v in tiny.GRANITE_SCALARS.items())
    plain_cfg = T.GraniteConfig(**{**model.config.to_dict(), **dict.fromkeys(tiny.GRANITE_SCALARS, 1.0)})
    plain = T.GraniteForCausalLM(plain_cfg).eval()
    plain.load_state_dict(model.state_dict())
    assert float((_logits(plain) - _logits(model)).abs().max()) > 1e-2
    report = verify_model(model, "orthogonal", seed=3)
    assert report.classes["res"] == "orthogonal"
    assert report.compared and report.max_abs_diff <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# LayerNorm with bias on the stream: only rotations that fix the all-ones vector


@pytest.mark.parametrize("case", ["starcoder2", "starcoder2-cls"])
def test_layernorm_stream_rotations_must_fix_ones(case):
    """Negative control: on the canonical form a rotation fixing 1 keeps the logits, a generic one
    (which LayerNorm's mean subtraction does not commute with) moves them."""
    model = tiny.FACTORIES[case](0)
    graph = graph_for(model.config, model.state_dict().keys())
    assert graph.spaces["res"].max_class == "orthogonal" and graph.spaces["res"].centered
    assert _rotate_stream(model, fix_ones=True) <= TOLERANCE
    assert _rotate_stream(model, fix_ones=False) > 1e-3
