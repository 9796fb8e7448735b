"""Encoder-decoders: the negative controls that make the one-stream-map claim more than a claim.
A transform that the adapter allows keeps the outputs (tests/symmetry/test_adapters.py); these
break the rule in one place each, and the outputs must move."""

from __future__ import annotations

import pytest
import torch

import tiny
from hf_rebasin.alignment.verify import example_inputs, outputs_of, transformed_model
from hf_rebasin.io.rebuild import rebuild
from hf_rebasin.symmetry.adapters import REGISTRY
from hf_rebasin.symmetry.transforms import AxisMap


def _moved_max_diff(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> float:
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model, spec, inputs)
    after = outputs_of(rebuild(model, sd), spec, inputs)
    return max((after[k] - before[k]).abs().max().item() for k in before if k == "logits")


def _res_permutation(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    new, _graph, transform, _ = transformed_model(model, "permutation", seed=3)
    res = transform["res"]
    assert isinstance(res, AxisMap) and res.index is not None
    return dict(new.state_dict()), res.index


def test_a_permuted_bart_keeps_its_logits_only_if_cross_attention_reads_the_encoders_map() -> None:
    """Cross-attention's keys and values read the encoder's output: columns left in the old basis
    (as if the encoder's stream had a map of its own, the identity) change the logits."""
    model = tiny.bart(0)
    sd, index = _res_permutation(model)
    assert _moved_max_diff(model, sd) < 1e-4  # the allowed transform itself
    inverse = torch.argsort(index)
    for name in list(sd):
        if ".encoder_attn.k_proj.weight" in name or ".encoder_attn.v_proj.weight" in name:
            sd[name] = sd[name][:, inverse]
    assert _moved_max_diff(model, sd) > 1e-3


def test_the_encoder_and_decoder_streams_cannot_take_two_maps() -> None:
    """The decoder's stream must take the encoder's map: its layers left in the old basis (a second
    map, the identity, for the decoder's stream) while the shared table, the encoder and
    cross-attention move change the logits."""
    model = tiny.bart(0)
    original = model.state_dict()
    sd, _index = _res_permutation(model)
    for name in list(sd):
        if ".decoder." in name and ".encoder_attn." not in name and "embed_tokens" not in name:
            sd[name] = original[name]
    assert _moved_max_diff(model, sd) > 1e-3


def test_per_sublayer_residual_maps_are_refused_for_an_encoder_decoder() -> None:
    from hf_rebasin.core.errors import AdapterError
    from hf_rebasin.symmetry.adapters import graph_for
    from hf_rebasin.symmetry.sublayers import per_sublayer

    model = tiny.bart(0)
    graph = graph_for(model.config, model.state_dict().keys())
    assert graph.stacks == ("model.encoder", "model.decoder")
    with pytest.raises(AdapterError, match="encoder-decoder"):
        per_sublayer(graph)
