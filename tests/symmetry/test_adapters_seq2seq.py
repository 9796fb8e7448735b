"""Encoder-decoders: the negative controls that make the one-stream-map claim more than a claim.
A transform that the adapter allows keeps the outputs (tests/symmetry/test_adapters.py); these
break the rule in one place each, and the outputs must move."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tiny
from hf_rebasin.alignment.verify import compare, example_inputs, outputs_of, transformed_model
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


def _heads_index(perm: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The features of heads ``perm`` (new head h is old head perm[h]), ``head_dim`` each."""
    return (perm[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _hidden_moved(model: torch.nn.Module, sd: dict[str, torch.Tensor], graph: Any, transform: Any) -> float:
    """max |Δ| of the outputs, the hidden states mapped by ``transform`` first (their basis moves)."""
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before, after = outputs_of(model, spec, inputs), outputs_of(rebuild(model, sd), spec, inputs)
    return compare(spec, graph, transform, before, after)


T5_BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def test_t5_heads_keep_one_order_per_stack_because_the_position_bias_is_shared() -> None:
    """Every encoder layer adds block 0's position bias to its scores, column h to head h: heads
    permuted layer by layer (each layer its own order) with the bias left as it is move the logits,
    though each layer's q/k/v/o move together; so do the bias columns permuted without the heads."""
    model = tiny.t5(0)
    original = dict(model.state_dict())
    heads, dh = model.config.num_heads, model.config.d_kv
    g = torch.Generator().manual_seed(4)
    sd = dict(original)
    for i in range(model.config.num_layers):
        index = _heads_index(torch.randperm(heads, generator=g), dh)
        attn = f"encoder.block.{i}.layer.0.SelfAttention"
        for r in "qkv":
            sd[f"{attn}.{r}.weight"] = sd[f"{attn}.{r}.weight"][index]
        sd[f"{attn}.o.weight"] = sd[f"{attn}.o.weight"][:, index]
    assert _moved_max_diff(model, sd) > 1e-3
    columns = dict(original)
    columns[T5_BIAS] = original[T5_BIAS][:, torch.roll(torch.arange(heads), 1)]
    assert _moved_max_diff(model, columns) > 1e-3


def test_t5_heads_and_their_bias_columns_permuted_together_keep_the_logits() -> None:
    """The positive twin of the controls above: one head order for the whole encoder, the bias
    columns with it (the adapter's role ``h``), through the graph."""
    from hf_rebasin.symmetry.adapters import graph_for

    model = tiny.t5(0)
    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    transform = graph.identity()
    transform["enc.self"] = graph.random_transform("permutation", torch.Generator().manual_seed(2))["enc.self"]
    moved = graph.apply(sd, transform)
    assert not torch.equal(moved[T5_BIAS], sd[T5_BIAS])
    assert _moved_max_diff(model, moved) < 1e-4


def test_a_rotation_of_the_t5_encoder_models_stream_is_refused_and_wrong() -> None:
    """T5EncoderModel's final norm is its output: its γ cannot be folded, so its stream keeps signed
    permutations only; a rotation (after canonical form) is refused and, forced through, moves the
    hidden states."""
    from hf_rebasin.core.errors import TransformError
    from hf_rebasin.symmetry.adapters import graph_for
    from hf_rebasin.symmetry.canonical import canonicalize
    from hf_rebasin.symmetry.transforms import random_orthogonal

    model = tiny.t5_encoder(0)
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    assert not untied and graph.spaces["res"].max_class == "signed-permutation"
    transform = graph.identity()
    assert _hidden_moved(model, sd, graph, transform) < 1e-4  # the canonical form alone is exact
    size = graph.spaces["res"].size
    transform["res"] = AxisMap(size, blocks=random_orthogonal(size, torch.Generator().manual_seed(1))[None])
    with pytest.raises(TransformError, match="signed permutations"):
        graph.apply(sd, transform)
    assert _hidden_moved(model, graph.apply(sd, transform, check=False), graph, transform) > 1e-3
    signed = graph.random_transform("orthogonal", torch.Generator().manual_seed(1))  # what it allows
    assert _hidden_moved(model, graph.apply(sd, signed), graph, signed) < 1e-4


def test_a_bare_t5_is_told_by_its_missing_head_not_by_a_prefix() -> None:
    """T5ForConditionalGeneration has no prefix yet is no bare model: its final norms fold (the
    stream stays orthogonal). T5Model has no head: both final norms' outputs are outputs, their
    readers kept apart, and its stream keeps signed permutations, which preserve its hidden states."""
    import transformers as T

    from hf_rebasin.alignment.verify import TOLERANCE, verify_model
    from hf_rebasin.symmetry.adapters import graph_for

    lm = tiny.t5(0)
    assert graph_for(lm.config, lm.state_dict().keys()).spaces["res"].max_class == "orthogonal"
    torch.manual_seed(0)
    bare = tiny._randomize_norms(T.T5Model(tiny._t5_config()), 0)
    graph = graph_for(bare.config, bare.state_dict().keys())
    assert graph.spaces["res"].max_class == "signed-permutation"
    assert set(graph.output_readers) == {"encoder.final_layer_norm.weight"}  # the decoder's has no reader
    assert len(graph.output_readers["encoder.final_layer_norm.weight"]) == 2 * bare.config.num_decoder_layers
    report = verify_model(bare, "orthogonal", seed=1)
    assert report.compared == ["last_hidden_state"] and report.max_abs_diff <= TOLERANCE


def _whisper_permuted(model: torch.nn.Module, stream: str, seed: int) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """``model``'s state with only ``stream`` permuted (every other space the identity)."""
    from hf_rebasin.symmetry.adapters import graph_for

    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    transform = graph.identity()
    transform[stream] = graph.random_transform("permutation", torch.Generator().manual_seed(seed))[stream]
    return graph.apply(sd, transform), graph, transform


def test_whisper_cross_attention_reads_the_encoders_stream_not_the_decoders() -> None:
    """Whisper has two streams: cross-attention's keys and values read the encoder's (after its final
    norm), its queries the decoder's. The decoder's stream permuted keeps the logits; the keys' and
    values' columns permuted with the decoder's map as well (as if they read the decoder's stream)
    move them."""
    model = tiny.whisper(0)
    sd, _graph, transform = _whisper_permuted(model, "dec.res", seed=3)
    assert _moved_max_diff(model, sd) < 1e-4  # the allowed transform itself
    index = transform["dec.res"].index
    assert index is not None and not torch.equal(index, torch.arange(len(index)))
    for name in list(sd):
        if ".encoder_attn.k_proj.weight" in name or ".encoder_attn.v_proj.weight" in name:
            sd[name] = sd[name][:, index]
    assert _moved_max_diff(model, sd) > 1e-3


def test_whisper_encoder_positions_are_stored_and_move_with_the_encoders_stream() -> None:
    """The encoder's positions are a stored table (not regenerated on load): the encoder's stream
    permuted keeps the logits only if its columns move too."""
    model = tiny.whisper(0)
    original = model.state_dict()
    sd, _graph, _transform = _whisper_permuted(model, "enc.res", seed=5)
    assert _moved_max_diff(model, sd) < 1e-4
    table = "model.encoder.embed_positions.weight"
    assert not torch.equal(sd[table], original[table])
    sd[table] = original[table]
    assert _moved_max_diff(model, sd) > 1e-3


def test_a_rotation_of_whispers_encoder_stream_is_refused_and_wrong() -> None:
    """GELU after conv2 writes the encoder's stream: no rotation commutes with it. The adapter keeps
    permutations there (and rotates the decoder's); a rotation of the encoder's stream, even after
    canonical form, is refused and, forced through, moves the logits."""
    from hf_rebasin.core.errors import TransformError
    from hf_rebasin.symmetry.adapters import graph_for
    from hf_rebasin.symmetry.canonical import canonicalize
    from hf_rebasin.symmetry.transforms import random_orthogonal

    model = tiny.whisper(0)
    sd, graph, untied = canonicalize(graph_for(model.config, model.state_dict().keys()), model.state_dict())
    assert untied == ["proj_out.weight"]  # the decoder's final norm folds into the head, not its embeddings
    assert graph.spaces["enc.res"].max_class == "permutation"
    assert graph.spaces["dec.res"].max_class == "orthogonal" and graph.spaces["dec.res"].centered
    rotated = graph.random_transform("orthogonal", torch.Generator().manual_seed(1))
    dec = rotated["dec.res"]
    assert isinstance(dec, AxisMap) and dec.blocks is not None and (dec.matrix().abs() > 1e-3).float().mean() > 0.5
    size = graph.spaces["enc.res"].size
    transform = graph.identity()
    transform["enc.res"] = AxisMap(size, blocks=random_orthogonal(size, torch.Generator().manual_seed(2))[None])
    with pytest.raises(TransformError):
        graph.apply(sd, transform)
    moved = dict(graph.apply(sd, transform, check=False))
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before = outputs_of(model, spec, inputs)["logits"]
    after = outputs_of(rebuild(model, moved, untie=True), spec, inputs)["logits"]
    assert (after - before).abs().max().item() > 1e-3


def test_whisper_logits_match_an_independent_forward() -> None:
    """The adapter's example inputs are what WhisperForConditionalGeneration itself accepts: the
    logits equal a plain call on the same features and decoder ids, and the encoder refuses any other
    number of frames (so the inputs cannot silently be cut)."""
    model = tiny.whisper(0)
    spec = REGISTRY.get("whisper")
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    frames = 2 * model.config.max_source_positions
    assert inputs["input_features"].shape == (2, model.config.num_mel_bins, frames)
    with torch.no_grad():
        plain = model(
            input_features=inputs["input_features"],
            decoder_input_ids=inputs["decoder_input_ids"],
            decoder_attention_mask=inputs["decoder_attention_mask"],
        ).logits
        assert torch.equal(outputs_of(model, spec, inputs)["logits"], plain)
        with pytest.raises(ValueError):
            model(input_features=inputs["input_features"][..., :-2], decoder_input_ids=inputs["decoder_input_ids"])


def _stream_permuted(model: torch.nn.Module, seed: int = 3) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``model``'s state with the stream permuted as for BART (heads and units left alone), forced
    past the pin; and the permutation."""
    from hf_rebasin.symmetry.adapters import graph_for

    sd = model.state_dict()
    graph = graph_for(model.config, sd.keys())
    assert graph.spaces["res"].pinned
    size = graph.spaces["res"].size
    index = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    transform = {**graph.identity(), "res": AxisMap(size, index=index)}
    return dict(graph.apply(sd, transform, check=False)), index


def test_a_marian_stream_permutation_looks_exact_in_memory_and_breaks_after_a_reload(tmp_path) -> None:
    """Marian's sinusoidal table is a parameter in memory: permuted with the stream, the logits stay.
    But it is never saved and is regenerated on load, in the old basis: after save_pretrained and
    from_pretrained the logits move. This is why the stream is pinned."""
    import transformers as T

    model = tiny.marian(0)
    sd, index = _stream_permuted(model)
    for stack in ("encoder", "decoder"):
        name = f"model.{stack}.embed_positions.weight"
        sd[name] = sd[name][:, index]  # what BART's learned table would take
    moved = rebuild(model, sd)
    assert _moved_max_diff(model, sd) < 1e-4  # looks exact in memory
    moved.save_pretrained(tmp_path)
    assert "model.encoder.embed_positions.weight" not in _saved_keys(tmp_path)
    reloaded = T.MarianMTModel.from_pretrained(tmp_path).eval()
    spec = REGISTRY.get("marian")
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before, after = outputs_of(model, spec, inputs), outputs_of(reloaded, spec, inputs)
    assert (after["logits"] - before["logits"]).abs().max().item() > 1e-3


def _saved_keys(folder: Any) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_an_m2m100_stream_permutation_moves_the_logits_in_memory() -> None:
    """M2M100's sinusoidal table is a buffer outside the state dict: no map of the stream can move
    it, so a stream permutation moves the logits even before any reload."""
    model = tiny.m2m100(0)
    assert not any("embed_positions" in k for k in model.state_dict())
    sd, _index = _stream_permuted(model)
    assert _moved_max_diff(model, sd) > 1e-3


@pytest.mark.parametrize("case", ["marian", "m2m100", "marian-apart"])
def test_pinned_families_keep_their_logits_through_a_reload_when_heads_and_units_move(case, tmp_path) -> None:
    """The positive twin: what the adapter allows (heads and units, the stream at the identity)
    keeps the logits of the stock class after save_pretrained and from_pretrained."""
    model = tiny.FACTORIES[case](0)
    new, _graph, transform, _ = transformed_model(model, "orthogonal", seed=2)
    assert transform["res"].is_identity() and not all(m.is_identity() for m in transform.values())
    new.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    spec = REGISTRY.get(model.config.model_type)
    inputs = example_inputs(spec, model.config, torch.Generator().manual_seed(7))
    before, after = outputs_of(model, spec, inputs), outputs_of(reloaded, spec, inputs)
    assert (after["logits"] - before["logits"]).abs().max().item() < 1e-4
