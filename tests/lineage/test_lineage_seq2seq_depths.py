"""Lineage across depths for encoder-decoders: a layer map per stack. A child pruned in one stack or
both (distilbart's decoder, distil-whisper's first and last decoder layers, a T5 pruned in both
stacks; mBART, Marian, M2M100 and mT5 too), as stored or after its heads, units and residual stream
were permuted, is mapped stack by stack onto its parent; a pruned model of another seed has no kin
layer in either stack; align still refuses encoder-decoders of other depths."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import transformers as T

import tiny
from helpers import assert_user_error, flat, run_main
from hf_rebasin.lineage.compare import ALPHA
from hf_rebasin.lineage.record import LineageRecord
from hf_rebasin.symmetry.adapters import graph_for

# per family: the config fields of each stack's depth, each stack's module list, the loader
BARTS = ("bart", "whisper", "mbart", "marian", "m2m100")  # the module lists and depth fields of BART
LAYERS = {
    **dict.fromkeys(BARTS, ("encoder_layers", "decoder_layers")),
    **dict.fromkeys(("t5", "mt5"), ("num_layers", "num_decoder_layers")),
}
STACKS = {
    **dict.fromkeys(BARTS, ("model.encoder.layers", "model.decoder.layers")),
    **dict.fromkeys(("t5", "mt5"), ("encoder.block", "decoder.block")),
}
AUTO = {family: T.AutoModelForSpeechSeq2Seq if family == "whisper" else T.AutoModelForSeq2SeqLM for family in LAYERS}
# the parent's depths (encoder, decoder) and the layers each stack of the child keeps
CASES = {
    "bart": ((4, 6), ([0, 1, 2, 3], [0, 2, 5])),  # distilbart: one encoder depth, every other decoder layer
    "whisper": ((3, 4), ([0, 1, 2], [0, 3])),  # distil-whisper: the decoder's first and last layers
    "t5": ((4, 4), ([1, 3], [0, 1, 3])),  # both stacks pruned; the encoder's layer 0 dropped
}


def _model(family: str, seed: int, depths: tuple[int, int]) -> torch.nn.Module:
    """A random model of ``family`` with the tiny zoo's widths and these stack depths."""
    base = tiny.FACTORIES[family](seed)
    config = copy.deepcopy(base.config)
    for field, n in zip(LAYERS[family], depths, strict=True):
        setattr(config, field, n)
    torch.manual_seed(seed)
    model = type(base)(config)
    if family in ("t5", "mt5"):
        tiny._head_apart(model)  # as tiny.t5: the LM head stored apart from the embeddings
    return tiny._randomize_norms(model, seed)


def _pruned(family: str, parent: torch.nn.Module, kept: tuple[list[int], list[int]], moved: bool = False):
    """The parent's layers ``kept[s]`` of each stack s copied into a shallower model of the stock
    class (its embeddings and head too), optionally after a random permutation of the parent's
    heads, MLP units and residual stream. A tensor only some layers hold (T5's relative attention
    bias, layer 0's) is copied from where the parent holds it, as a pruner must."""
    sd = parent.state_dict()
    if moved:
        graph = graph_for(parent.config, sd.keys())
        sd = graph.apply(sd, graph.random_transform("permutation", torch.Generator().manual_seed(7)))
    child = _model(family, 99, (len(kept[0]), len(kept[1])))
    out = {}
    for name in child.state_dict():
        out[name] = sd[name]
        for key, layers in zip(STACKS[family], kept, strict=True):
            found = re.match(rf"^{re.escape(key)}\.(\d+)\.(.*)$", name)
            if found is not None and f"{key}.{layers[int(found.group(1))]}.{found.group(2)}" in sd:
                out[name] = sd[f"{key}.{layers[int(found.group(1))]}.{found.group(2)}"]
    child.load_state_dict(out)
    return child


def _check_copied(family: str, folder: Path, parent: torch.nn.Module, kept: tuple[list[int], list[int]]) -> None:
    """The ground truth, independent of lineage: the written child loads with transformers and
    each of its layers holds its source layer's tensors exactly."""
    child = AUTO[family].from_pretrained(str(folder)).state_dict()
    theirs = parent.state_dict()
    compared = 0
    for key, layers in zip(STACKS[family], kept, strict=True):
        for j, i in enumerate(layers):
            mine = {n[len(f"{key}.{j}.") :]: t for n, t in child.items() if n.startswith(f"{key}.{j}.")}
            assert mine
            for rest, t in mine.items():
                if f"{key}.{i}.{rest}" in theirs:
                    assert torch.equal(t, theirs[f"{key}.{i}.{rest}"]), (key, j, rest)
                    compared += 1
    assert compared > 10


def _lineage(*folders: Path) -> LineageRecord:
    proc = run_main("lineage", *map(str, folders), "--json")
    assert proc.returncode == 0, proc.stderr
    return LineageRecord.model_validate_json(proc.stdout)


def _sources(record: LineageRecord, a: int, b: int, family: str) -> list[list[int | None]]:
    """Each stack's sources of the pair's map, B's layers in A's (either mapped onto the other for
    a pair with no kin layer)."""
    pair = next(p for p in record.pairs if (p.a, p.b) == (a, b))
    assert pair.layer_map is None and [m.stack for m in pair.stack_maps] == list(STACKS[family])
    for m in pair.stack_maps:
        assert {m.model, *m.parents} == {a, b} and m.mergekit == ""
        assert pair.verdict == "independent" or (m.model, m.parents) == (b, [a])
    return [[x.source for x in m.layers] for m in pair.stack_maps]


@pytest.mark.parametrize("family", list(CASES))
def test_a_pruned_encoder_decoder_is_mapped_stack_by_stack(family: str, saved_model) -> None:
    depths, kept = CASES[family]
    parent, other = _model(family, 0, depths), _model(family, 1, depths)
    folders = [
        saved_model(parent, name="parent"),
        saved_model(_pruned(family, parent, kept), name="pruned"),
        saved_model(_pruned(family, parent, kept, moved=True), name="moved"),
        saved_model(_pruned(family, other, kept), name="other"),
    ]
    _check_copied(family, folders[1], parent, kept)
    record = _lineage(*folders)
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts[(0, 1)] == "same basis" and verdicts[(0, 2)] == "related up to symmetry", verdicts
    assert verdicts[(0, 3)] == verdicts[(1, 3)] == "independent", verdicts
    assert verdicts[(1, 2)] == "related up to symmetry"  # one depth: the two copies, one moved
    for b in (1, 2):  # the symmetries are quotiented out: the moved copy's map is the plain one's
        assert _sources(record, 0, b, family) == list(kept)
        pair = next(p for p in record.pairs if (p.a, p.b) == (0, b))
        assert all(x.log10_p < -300 for m in pair.stack_maps for x in m.layers)  # ALPHA by far
    assert all(s is None for stack in _sources(record, 0, 3, family) for s in stack)
    unrelated = next(p for p in record.pairs if (p.a, p.b) == (0, 3))
    assert all(x.log10_p >= math.log10(ALPHA) for m in unrelated.stack_maps for x in m.layers)
    assert record.models[1].stacks == dict(zip(STACKS[family], map(len, kept), strict=True))
    assert record.models[0].stacks == dict(zip(STACKS[family], depths, strict=True))


@pytest.mark.slow  # BART, Whisper and T5 are mapped in the fast suite; their relatives' layouts here
@pytest.mark.parametrize("family", ["mbart", "marian", "m2m100", "mt5"])
def test_every_other_encoder_decoder_family_is_mapped_stack_by_stack(family: str, saved_model) -> None:
    kept = ([0, 2, 3], [0, 3])
    parent = _model(family, 0, (4, 4))
    moved = saved_model(_pruned(family, parent, kept, moved=True), name="moved")
    _check_copied(family, saved_model(_pruned(family, parent, kept), name="pruned"), parent, kept)
    other = saved_model(_pruned(family, _model(family, 1, (4, 4)), kept), name="other")
    record = _lineage(saved_model(parent, name="parent"), moved, other)
    verdicts = {(p.a, p.b): p.verdict for p in record.pairs}
    assert verdicts[(0, 1)] == "related up to symmetry" and verdicts[(0, 2)] == "independent", verdicts
    assert _sources(record, 0, 1, family) == list(kept)
    assert all(s is None for stack in _sources(record, 0, 2, family) for s in stack)


def test_the_report_says_per_stack_which_layers_of_the_parent_the_childs_are(saved_model, tmp_path: Path) -> None:
    depths, kept = CASES["bart"]
    parent = _model("bart", 0, depths)
    a, b = saved_model(parent, name="bart-large"), saved_model(_pruned("bart", parent, kept), name="distilbart")
    record = _lineage(a, b)
    step = " ".join(record.pairs[0].next_step.split())
    assert f"{b} is depth-pruned from {a}, a layer map per stack" in step, step
    assert f"decoder: layers 0, 2, 5 of {a} are layers 0–2 of {b}; encoder: one depth, every layer kin" in step, step
    kinds = [m.kind for m in record.pairs[0].stack_maps]
    assert kinds == ["identity", "depth-pruned"]
    proc = run_main("lineage", str(b), str(a), "--output", str(tmp_path / "out"))  # the child given first
    assert proc.returncode == 0, proc.stderr
    text = flat(proc.stdout)
    assert "depth-pruned, model.decoder.layers" in text and "identity, model.encoder.layers" in text, text
    written = LineageRecord.model_validate_json((tmp_path / "out" / "lineage.json").read_text())
    assert [[x.source for x in m.layers] for m in written.pairs[0].stack_maps] == list(kept)
    assert written.pairs[0].stack_maps[0].model == 0 and written.pairs[0].stack_maps[0].parents == [1]


def test_merge_and_align_still_refuse_encoder_decoders_of_other_depths(saved_model, tmp_path: Path) -> None:
    depths, kept = CASES["t5"]
    parent = _model("t5", 0, depths)
    a, b = str(saved_model(parent, name="t5")), str(saved_model(_pruned("t5", parent, kept), name="pruned"))
    proc = run_main("align", a, b, "--output", str(tmp_path / "aligned"))
    assert_user_error(proc, "has 2 encoder and 3 decoder layers", "hf-rebasin lineage A B")
    assert "not built" not in flat(proc.stderr)
    assert not (tmp_path / "aligned").exists()
