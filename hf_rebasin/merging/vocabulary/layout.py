"""The embedding rows of a run's models in one layout, matched by token, and the rows of its output.

Models whose vocabularies differ (added tokens, an extended release, padding rows) are brought to
one *working layout* before anything aligns them, as models of other widths are brought to the
widest: the reference's rows first, at its own ids (so data tokenized by its tokenizer reads the
same rows in every model), then the tokens only the others have, then the reference's padding
rows. A model's row for a token it lacks is zero until the merge fills it (`fill`): zero
rows add nothing to the weight statistics the alignment sums over the vocabulary, so it matches
the models on the tokens they share, and the maps it finds apply to every row.

The output takes a selection of the working rows (`OutputRows`): the reference's layout, the union,
another model's layout, or the reference's plus a fine-tune's tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.lazy import gather_rows
from hf_rebasin.io.models import LoadedModel, to_device
from hf_rebasin.merging.vocabulary.tokens import Vocabulary

__all__ = [
    "TOKEN_ID_FIELDS",
    "OutputRows",
    "RowLayout",
    "embedding_rows_of",
    "read_vocabularies",
    "reindex",
    "remap_generation_config",
    "remap_token_ids",
    "shared_layout",
    "to_shared_rows",
    "vocab_field",
    "vocab_tensors",
    "working_layout",
]

# config and generation-config fields that hold token ids (a list for some eos_token_id)
TOKEN_ID_FIELDS = (
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "unk_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
)  # fmt: skip


@dataclass(frozen=True)
class RowLayout:
    """Working rows, and for each model the row of its own that each working row is (-1: none).

    ``keys[w]``: the token text of working row ``w`` (None: padding). Rows ``[0, reference)`` are the
    reference's own; ``new`` are tokens the reference lacks; ``padding`` the reference's padding rows.
    """

    keys: tuple[str | None, ...]
    sources: tuple[tuple[int, ...], ...]
    reference: int
    new: tuple[int, ...]
    padding: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.keys)

    def unchanged(self, i: int) -> bool:
        """Whether model ``i``'s rows are the working rows already (nothing to move)."""
        return self.sources[i] == tuple(range(self.rows))

    def present(self, i: int) -> Tensor:
        """Model ``i``'s working rows that hold a row of its own (bool)."""
        return torch.tensor(self.sources[i], dtype=torch.long) >= 0

    def row(self, key: str) -> int | None:
        return next((w for w, k in enumerate(self.keys) if k == key), None)


def working_layout(vocabularies: Sequence[Vocabulary]) -> RowLayout:
    """The working rows of models with these vocabularies (the first is the reference)."""
    ref = vocabularies[0]
    keys: list[str | None] = list(ref.keys[: ref.tokens])
    seen = {k for k in keys if k is not None}
    new: list[int] = []
    for v in vocabularies[1:]:
        for k in v.keys[: v.tokens]:
            if k is not None and k not in seen:
                seen.add(k)
                new.append(len(keys))
                keys.append(k)
    padding = tuple(range(len(keys), len(keys) + ref.padding))
    keys.extend([None] * ref.padding)
    sources = []
    for v in vocabularies:
        rows = v.row_of()
        own = [rows.get(k, -1) if k is not None else -1 for k in keys]
        for j, w in enumerate(padding):  # padding rows: by their place past the tokens
            own[w] = v.tokens + j if v.tokens + j < v.rows else -1
        sources.append(tuple(own))
    return RowLayout(tuple(keys), tuple(sources), ref.tokens, tuple(new), padding)


@dataclass(frozen=True)
class OutputRows:
    """The output's rows as working rows (-1: a new padding row, the mean of the token rows), and
    how many of them are tokens."""

    rows: tuple[int, ...]
    tokens: int
    source: str  # how they were chosen, for notes

    @classmethod
    def reference(cls, layout: RowLayout, pad_to: int | None = None) -> OutputRows:
        return cls._with_padding(layout, list(range(layout.reference)), pad_to, "the reference's")

    @classmethod
    def union(cls, layout: RowLayout, pad_to: int | None = None, only: Sequence[int] | None = None) -> OutputRows:
        """The reference's tokens and the others' (``only``: of these models), reference ids first."""
        new = [w for w in layout.new if only is None or any(layout.sources[m][w] >= 0 for m in only)]
        return cls._with_padding(layout, list(range(layout.reference)) + new, pad_to, "union")

    @classmethod
    def of_model(cls, layout: RowLayout, vocabulary: Vocabulary, i: int, pad_to: int | None = None) -> OutputRows:
        """Model ``i``'s own layout: its tokens at its ids."""
        where = {s: w for w, s in enumerate(layout.sources[i]) if s >= 0}
        rows = [where.get(r, -1) for r in range(vocabulary.tokens)]
        out = cls._with_padding(layout, rows, pad_to, f"model {i}'s", keep=vocabulary.rows)
        return dataclasses.replace(out, rows=tuple(where.get(r, w) for r, w in enumerate(out.rows)))

    @classmethod
    def _with_padding(
        cls, layout: RowLayout, rows: list[int], pad_to: int | None, source: str, keep: int | None = None
    ) -> OutputRows:
        tokens = len(rows)
        total = max(tokens, keep if keep is not None else layout.reference + len(layout.padding))
        if pad_to:
            total = -(-total // pad_to) * pad_to
        spare = list(layout.padding)
        rows += [spare.pop(0) if spare else -1 for _ in range(total - tokens)]
        return cls(tuple(rows), tokens, source)

    def take(self, t: Tensor, axis: int = 0) -> Tensor:
        """``t``'s output rows (working rows on ``axis``); new padding rows: the mean token row."""
        t = t.movedim(axis, 0)
        idx = torch.tensor(self.rows, dtype=torch.long, device=t.device)
        out = t[idx.clamp(min=0)]
        if bool((idx < 0).any()):
            out[idx < 0] = t[idx[: self.tokens].clamp(min=0)].mean(0).to(t.dtype)
        return out.movedim(0, axis)


def embedding_rows_of(model: Any) -> int | None:
    """Rows of a text model's input embedding (None: a model without token embeddings)."""
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    if not hasattr(emb, "num_embeddings") or weight is None or weight.dim() != 2:
        return None
    return int(weight.shape[0])


def shared_layout(vocabularies: Sequence[Vocabulary]) -> RowLayout:
    """Rows of the tokens every model has, in the reference's order: what a comparison of the
    models reads (lineage: a new release is judged on the rows it shares with the old one)."""
    rows = [v.row_of() for v in vocabularies]
    keys = tuple(k for k in vocabularies[0].keys if k is not None and all(k in r for r in rows))
    sources = tuple(tuple(r[k] for k in keys) for r in rows)
    return RowLayout(keys, sources, len(keys), (), ())


def read_vocabularies(folders: Sequence[Path], rows: Sequence[int | None]) -> tuple[list[Any], list[Vocabulary]] | None:
    """The tokenizers of ``folders`` and the vocabularies they give embeddings of ``rows`` rows;
    None where a model has no token embedding (rows None) or no tokenizer. A tokenizer that does
    not load is the caller's `TokenizerError`."""
    from hf_rebasin.merging.vocabulary.files import load_tokenizer
    from hf_rebasin.merging.vocabulary.tokens import read_vocabulary

    if any(r is None for r in rows):
        return None
    tokenizers = [load_tokenizer(f) for f in folders]
    if any(t is None for t in tokenizers):
        return None
    return tokenizers, [read_vocabulary(t, r) for t, r in zip(tokenizers, rows, strict=True)]  # type: ignore[arg-type]


def to_shared_rows(models: Sequence[LoadedModel]) -> tuple[list[LoadedModel], str | None]:
    """``models`` (streamed ones stay streamed) keeping only the rows of the tokens they all have, matched by token,
    and a note saying what was left out; as they are (and None) where their vocabularies agree or
    one has no tokenizer or token embedding."""
    from hf_rebasin.merging.vocabulary.tokens import compare_vocabularies

    rows = [embedding_rows_of(lm.model) for lm in models]
    found = read_vocabularies([lm.path for lm in models], rows)
    if found is None:
        return list(models), None
    vocabularies = found[1]
    if all(v.keys == vocabularies[0].keys for v in vocabularies[1:]):
        return list(models), None
    layout = shared_layout(vocabularies)
    out = [
        lm if layout.unchanged(i) and rows[i] == layout.rows else reindex(lm, layout, i, vocabularies[i])
        for i, lm in enumerate(models)
    ]
    differences = "; ".join(
        compare_vocabularies(vocabularies[0], v).describe("model 1", f"model {i + 1}")
        for i, v in enumerate(vocabularies[1:], start=1)
    )
    return out, f"compared on the {layout.rows:,} tokens every model has, rows matched by token ({differences})"


def vocab_tensors(model: Any) -> dict[str, int]:
    """Name → vocabulary axis of every tensor of ``model`` with a row per token: the input
    embedding, the LM head and its bias (tied names each)."""
    ids: dict[int, int] = {}
    emb = model.get_input_embeddings()
    if emb is not None and getattr(emb, "weight", None) is not None:
        ids[id(emb.weight)] = 0
    out = model.get_output_embeddings()
    if out is not None:
        ids[id(out.weight)] = 0
        if getattr(out, "bias", None) is not None:
            ids[id(out.bias)] = out.bias.dim() - 1
    return {n: ids[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def vocab_field(config: Any) -> tuple[Any, str] | None:
    """The config (or sub-config) and field that hold the embedding's row count."""
    for owner in (config, getattr(config, "text_config", None)):
        if owner is not None and isinstance(getattr(owner, "vocab_size", None), int):
            return owner, "vocab_size"
    return None


def remap_token_ids(values: Mapping[str, Any], old: Sequence[str | None], new_row: Mapping[str, int]) -> dict[str, Any]:
    """``values``' token-id fields moved from rows ``old`` (row → token text) to ``new_row``; an id
    whose token is not there becomes None."""

    def moved(i: Any) -> Any:
        if isinstance(i, list):
            return [m for m in map(moved, i) if m is not None]
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(old):
            return i  # not an id of these rows (a config default past a tiny vocabulary): as it was
        key = old[i]
        return new_row.get(key) if key is not None else i

    return {k: moved(v) for k, v in values.items() if k in TOKEN_ID_FIELDS}


def reindex(lm: LoadedModel, layout: RowLayout, i: int, vocabulary: Vocabulary) -> LoadedModel:
    """Model ``i`` with its vocabulary rows at the working rows (zeros where it has no row); a
    streamed model stays streamed, its rows gathered from its files a block at a time."""
    names = vocab_tensors(lm.model)
    idx = torch.tensor(layout.sources[i], dtype=torch.long)
    have = idx >= 0
    config = copy.deepcopy(lm.model.config)
    found = vocab_field(config)
    if found is not None:
        owner, field = found
        setattr(owner, field, layout.rows)
        rows = {k: w for w, k in enumerate(layout.keys) if k is not None and have[w]}
        for key, value in remap_token_ids(vars(owner), vocabulary.keys, rows).items():
            setattr(owner, key, value)
    if lm.source is not None:
        from hf_rebasin.io.offload import empty_model

        if any(axis != 0 for axis in names.values()):
            raise AssertionError("a streamed model's vocabulary rows are gathered on the first axis only")
        model = empty_model(type(lm.model), config)
        source = gather_rows(lm.source, dict.fromkeys(names, idx))
        return _with_graph(dataclasses.replace(lm, model=model, source=source))
    state = dict(lm.model.state_dict())
    for name, axis in names.items():
        t = state[name].movedim(axis, 0)
        out = t.new_zeros((layout.rows, *t.shape[1:]))
        out[have.to(t.device)] = t[idx[have].to(t.device)]
        state[name] = out.movedim(0, axis)
    model = type(lm.model)(config)
    model.load_state_dict(state, strict=True)
    model.to(dtype=next(lm.model.parameters()).dtype)  # type: ignore[call-arg]
    to_device(model, next(lm.model.parameters()).device)
    return _with_graph(dataclasses.replace(lm, model=model.eval()))


def _with_graph(lm: LoadedModel) -> LoadedModel:
    """``lm`` with the symmetry graph of its (re-shaped) model."""
    from hf_rebasin.symmetry.adapters import graph_for

    return dataclasses.replace(lm, graph=graph_for(lm.model.config, lm.model.state_dict().keys()))


def remap_generation_config(path: Path, old: Sequence[str | None], rows: Mapping[str, int]) -> None:
    """generation_config.json's token ids (eos, pad, bos) at the output's rows."""
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    moved = remap_token_ids(data, old, rows)
    if moved != {k: data[k] for k in moved}:
        data.update(moved)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
