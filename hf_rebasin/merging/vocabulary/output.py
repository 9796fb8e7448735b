"""A run's vocabularies: the models' rows matched by token, the working layout they are loaded
into, the output's rows and the tokenizer written with them.

Built once at load when the models' vocabularies differ (added tokens, an extended release,
padding rows); None when they agree, and then nothing here runs. Which vocabulary the output has
is the job's choice (`core.names.VocabularyChoice`, made by its declaration from the recipe's
``tokenizer`` section); None for a job that decides none (lineage). The jobs call it at three
points: after alignment (`fill_merge` / `fill_transport`: rows a model lacks, in the common
basis), before writing (`output_state`, `output_template`: the output's rows and config) and when
writing (`write`: tokenizer files, generation config).
"""

from __future__ import annotations

import copy
import functools
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import IncompatibleModelsError, TokenizerError, named
from hf_rebasin.core.lazy import LazyState, gather_rows, mean_rows
from hf_rebasin.core.names import VocabularyChoice
from hf_rebasin.io.models import LoadedModel
from hf_rebasin.merging.interpolate import StorageKey, storage_key
from hf_rebasin.merging.vocabulary.checks import check_rows_by_position, config_rows, same_text
from hf_rebasin.merging.vocabulary.files import (
    differ_in_vocabulary,
    gate_tokenizer_files,
    load_tokenizer,
    loader_files,
    template_files,
)
from hf_rebasin.merging.vocabulary.fill import fill_merge, fill_transport
from hf_rebasin.merging.vocabulary.layout import (
    OutputRows,
    RowLayout,
    embedding_rows_of,
    read_vocabularies,
    reindex,
    remap_generation_config,
    remap_token_ids,
    vocab_field,
    vocab_tensors,
    working_layout,
)
from hf_rebasin.merging.vocabulary.tokens import Vocabulary, compare_vocabularies, read_vocabulary

__all__ = [
    "RunVocabulary",
    "matched_by_token",
    "of_choice",
    "planned_vocabulary",
    "run_vocabulary",
    "to_rows",
]


@dataclass
class RunVocabulary:
    """The models' vocabularies in a run where they differ (module docstring)."""

    layout: RowLayout
    vocabularies: tuple[Vocabulary, ...]
    tokenizers: tuple[Any, ...]
    folders: tuple[Path, ...]
    names: tuple[str, ...]  # how notes name the models
    output: OutputRows
    source: str  # the recipe's tokenizer.source as resolved
    written_from: int | None  # the model whose tokenizer files the output has as they are (None: built)
    chat_from: int | None = None  # a transport's fine-tune: its chat template goes with a built tokenizer
    tensors: dict[str, int] = field(default_factory=dict)  # the working model's vocabulary tensors -> axis
    cut_alike: bool = True  # every tokenizer cuts text as the reference's does (`checks.same_text`)

    def present(self) -> list[Tensor]:
        return [self.layout.present(i) for i in range(len(self.vocabularies))]

    def notes(self) -> list[str]:
        """What the record says: each model against the reference, and the output's vocabulary."""
        ref = self.vocabularies[0]
        out = [
            f"vocabularies: {compare_vocabularies(ref, v).describe(self.names[0], self.names[i])}"
            for i, v in enumerate(self.vocabularies[1:], start=1)
        ]
        out.append(self.output_line())
        return out

    def templates_from(self) -> int | None:
        """The model whose chat templates the output carries beside another model's tokenizer files:
        the written model has none, and the fine-tune (a transport) or else the reference has some.
        None: the written files' own (or a built tokenizer's, which has them)."""
        if self.written_from is None or template_files(self.folders[self.written_from]):
            return None
        donors = [i for i in (self.chat_from, 0) if i is not None and i != self.written_from]
        return next((i for i in donors if template_files(self.folders[i])), None)

    def output_line(self) -> str:
        rows = len(self.output.rows)
        built = (
            f"{self.names[self.written_from]}'s tokenizer files as they are"
            if self.written_from is not None
            else f"{self.names[0]}'s tokenizer with {self.output.tokens - self.layout.reference:,} tokens added"
        )
        donor = self.templates_from()
        if donor is not None:
            built += (
                f", with the chat templates of {self.names[donor]} ({', '.join(template_files(self.folders[donor]))})"
            )
        return (
            f"output vocabulary (tokenizer.source: {self.source}): {self.output.tokens:,} tokens in {rows:,} embedding "
            f"rows; {built}; rows matched by token, a row a model lacks taken from "
            + (
                "the base (or carried from the fine-tune)"
                if self.chat_from is not None
                else "the reference (else the mean)"
            )
        )

    def fill_merge(self, states: Sequence[Mapping[str, Tensor]]) -> list[Mapping[str, Tensor]]:
        return list(fill_merge(states, self.present(), self.tensors))

    def fill_transport(
        self, target: Mapping[str, Tensor], tau: Mapping[str, Tensor], moved_base: Mapping[str, Tensor]
    ) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor]]:
        t, b, f = self.present()
        return fill_transport(target, tau, moved_base, (t, b, f), self.tensors)

    def own(self, i: int) -> OutputRows:
        """Model ``i``'s own rows (its tokens at its ids, its padding): an aligned model written
        in its own vocabulary."""
        return OutputRows.of_model(self.layout, self.vocabularies[i], i)

    def output_state(self, state: Mapping[str, Tensor], rows: OutputRows | None = None) -> Mapping[str, Tensor]:
        """``state`` (working rows) with the output's rows (or ``rows``); tied names stay one tensor,
        a streamed state stays streamed."""
        chosen = rows if rows is not None else self.output
        if isinstance(state, LazyState):
            return _lazy_output(state, chosen, self.tensors)
        out: dict[str, Tensor] = {}
        done: dict[StorageKey, Tensor] = {}
        for name, t in state.items():
            if name in self.tensors:
                key = storage_key(t)
                if key not in done:
                    done[key] = chosen.take(t, self.tensors[name])
                out[name] = done[key]
            else:
                out[name] = t
        return out

    def output_template(self, model: Any, rows: OutputRows | None = None) -> Any:
        """A meta-device model of ``model``'s class with the output's (or ``rows``') row count and token ids."""
        from hf_rebasin.io.offload import empty_model

        chosen = rows if rows is not None else self.output
        config = copy.deepcopy(model.config)
        found = vocab_field(config)
        if found is not None:
            owner, name = found
            setattr(owner, name, len(chosen.rows))
            for key, value in remap_token_ids(vars(owner), self.layout.keys, self.output_row(chosen)).items():
                setattr(owner, key, value)
        return empty_model(type(model), config)

    def output_row(self, rows: OutputRows | None = None) -> dict[str, int]:
        """Token text → its row in the output (or in ``rows``)."""
        chosen, keys = rows if rows is not None else self.output, self.layout.keys
        return {keys[w]: r for r, w in enumerate(chosen.rows[: chosen.tokens]) if w >= 0 and keys[w]}  # type: ignore[misc]

    def tokenizer(self) -> Any:
        """The output's tokenizer, in memory: a model's own, or the reference's with tokens added."""
        if self.written_from is not None:
            return self.tokenizers[self.written_from]
        return _built(self)

    def write(self, folder: Path) -> None:
        """The output's tokenizer files and generation config into ``folder`` (the reference's
        support files are there already), checked: every token loads at the row that was carried."""
        for name in loader_files(folder):  # the reference's, carried already: replaced as a whole
            (folder / name).unlink()
        if self.written_from is not None:
            # what is copied is what passed the gate, the named chat templates included
            _copy(gate_tokenizer_files(self.folders[self.written_from]), folder)
            donor = self.templates_from()
            if donor is not None:  # none of its own: the templates the output would otherwise lose
                found = gate_tokenizer_files(self.folders[donor])
                _copy({n: found[n] for n in template_files(self.folders[donor])}, folder)
        else:
            _built(self).save_pretrained(str(folder))
        remap_generation_config(folder / "generation_config.json", self.layout.keys, self.output_row())
        self._check_written(folder)

    def _check_written(self, folder: Path) -> None:
        written = load_tokenizer(folder)
        got = read_vocabulary(written, len(self.output.rows)).keys[: self.output.tokens]
        want = tuple(self.layout.keys[w] if w >= 0 else None for w in self.output.rows[: self.output.tokens])
        wrong = [r for r, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        if wrong:
            r = wrong[0]
            raise TokenizerError(
                f"the output's tokenizer does not give row {r} the token whose row was written there ({want[r]!r}, "
                f"tokenizer: {got[r]!r}); set `tokenizer.source` to a model's own vocabulary"
            )


def _lazy_output(state: LazyState, rows: OutputRows, names: Mapping[str, int]) -> LazyState:
    """`RunVocabulary.output_state` of a streamed state: its output rows gathered a block at a time,
    a new padding row the mean token row (taken once per tensor, a block at a time)."""
    if any(axis != 0 for axis in names.values()):
        raise AssertionError("a streamed model's vocabulary rows are gathered on the first axis only")
    idx = torch.tensor(rows.rows, dtype=torch.long)
    tokens = idx[: rows.tokens].clamp(min=0)

    @functools.cache
    def mean_row(name: str) -> Tensor:
        return mean_rows(state, name, tokens)

    return gather_rows(state, {n: idx for n in names if n in state}, mean_row)


def _copy(files: Mapping[str, Path], folder: Path) -> None:
    """``{name: real path that passed the gate}`` copied into ``folder`` under their names."""
    for name, real in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(real, folder / name)


def _built(v: RunVocabulary) -> Any:
    """The reference's tokenizer with the output's other tokens added at their rows."""
    from tokenizers import AddedToken

    tok = load_tokenizer(v.folders[0])
    assert tok is not None  # the run's vocabularies were read from it
    layout = v.layout
    for r, w in enumerate(v.output.rows[layout.reference : v.output.tokens], start=layout.reference):
        m = next(i for i, s in enumerate(layout.sources) if s[w] >= 0)
        row = layout.sources[m][w]
        info = (getattr(v.tokenizers[m], "added_tokens_decoder", None) or {}).get(row)
        if info is not None:
            content = str(info.content)
            tok.add_tokens([info], special_tokens=bool(getattr(info, "special", False)))
        else:
            key = layout.keys[w] or ""
            content = key.encode("latin-1").decode("utf-8", errors="replace")
            tok.add_tokens([AddedToken(content, normalized=False)])
        got = tok.convert_tokens_to_ids(content)
        if got != r:
            raise TokenizerError(
                f"cannot build the output's tokenizer: token {content!r} of {v.names[m]} lands at id {got}, not at its "
                f"row {r} (the reference's tokenizer has gaps in its ids); set `tokenizer.source` to one model's "
                "vocabulary"
            )
    if v.chat_from is not None:
        template = getattr(v.tokenizers[v.chat_from], "chat_template", None)
        if template:
            tok.chat_template = template
    return tok


def _source_rows(
    choice: VocabularyChoice, layout: RowLayout, vocabularies: Sequence[Vocabulary]
) -> tuple[OutputRows, list[int]]:
    """The output's rows the job chose, and the models whose own files may hold them."""
    pad_to = choice.pad_to
    if choice.rows == "own":
        assert choice.model is not None, "one model's own rows name the model"
        out = OutputRows.of_model(layout, vocabularies[choice.model], choice.model, pad_to)
    elif choice.rows == "union":
        out = OutputRows.union(layout, pad_to, only=choice.only)
    else:
        out = OutputRows.reference(layout, pad_to)
    every = range(len(vocabularies))
    return out, list(choice.candidates if choice.candidates is not None else every)


def _own_layout(layout: RowLayout, v: Vocabulary, i: int, out: OutputRows) -> bool:
    """Whether model ``i``'s tokenizer describes ``out`` as it is: its tokens at the output's rows."""
    if v.rowless or v.tokens != out.tokens:
        return False
    own = OutputRows.of_model(layout, v, i)
    return own.rows[: v.tokens] == out.rows[: out.tokens]


def run_vocabulary(
    choice: VocabularyChoice, folders: Sequence[Path], names: Sequence[str], rows: Sequence[int | None]
) -> RunVocabulary | None:
    """The run's vocabularies when they differ (None when every model has the same tokens at the
    same rows, or some model has no tokenizer or no token embedding: then rows pair by index), the
    output's as the job chose it. ``rows``: each model's embedding rows (None: no token embedding),
    from the loaded model or, before any weight is read (the dry run), from config.json."""
    try:
        found = read_vocabularies(folders, rows)
    except TokenizerError:  # one that does not load was allowed (`allow_different_tokenizers`): rows by index
        return None
    if found is None:
        return None
    tokenizers, vocabularies = found
    if all(v.keys == vocabularies[0].keys for v in vocabularies[1:]) and not choice.pad_to:
        return None
    layout = working_layout(vocabularies)
    out, candidates = _source_rows(choice, layout, vocabularies)
    written = next((i for i in candidates if _own_layout(layout, vocabularies[i], i, out)), None)
    if written is None and vocabularies[0].rowless:
        raise TokenizerError(
            f"{names[0]}: its tokenizer has {len(vocabularies[0].rowless)} tokens without an embedding row "
            f"(such as {vocabularies[0].rowless[0][0]!r}, id {vocabularies[0].rowless[0][1]}), so the output's "
            "tokenizer cannot be built from it; set `tokenizer.source` to a model whose tokens all have rows"
        )
    return RunVocabulary(
        layout=layout,
        vocabularies=tuple(vocabularies),
        tokenizers=tuple(tokenizers),
        folders=tuple(folders),
        names=tuple(names),
        output=out,
        source=choice.source,
        written_from=written,
        chat_from=choice.chat_from,
        cut_alike=all(same_text(tokenizers[0], t) for t in tokenizers[1:]),
    )


def planned_vocabulary(
    choice: VocabularyChoice | None, folders: Sequence[Path], names: Sequence[str], wheres: Sequence[str]
) -> list[str]:
    """What the plan says about the vocabularies (nothing where they agree), from the tokenizers and
    config.json alone (``wheres``: the recipe fields of the models): each model against the
    reference, and the output's vocabulary; refused as the load would refuse."""
    if not differ_in_vocabulary(folders):
        return []
    found = of_choice(choice, folders, names, config_rows(folders, wheres))
    return found.notes() if found is not None else []


def of_choice(
    choice: VocabularyChoice | None, folders: Sequence[Path], names: Sequence[str], rows: Sequence[int | None]
) -> RunVocabulary | None:
    """`run_vocabulary` with the job's choice (errors under the recipe's ``tokenizer``), rows of
    other counts that nothing matches refused; None for a job that chooses none (lineage, which
    compares the rows of the tokens the models share: `lineage.pairs.lineage_of`)."""
    if choice is None:
        return None
    with named("`tokenizer`", unless_named=True):
        found = run_vocabulary(choice, folders, names, rows)
    if found is None:
        check_rows_by_position(names, folders, rows)
    return found


def matched_by_token(choice: VocabularyChoice, folders: Sequence[Path], names: Sequence[str]) -> RunVocabulary | None:
    """The vocabularies of ``folders`` as a run with ``choice`` would match them (from the
    tokenizers and config.json, no weight): None where rows pair by position; refused as the run
    would refuse rows of other counts that nothing matches."""
    if not differ_in_vocabulary(folders):
        return None
    rows = config_rows(folders, names)
    found = run_vocabulary(choice, folders, names, rows)
    if found is None:
        check_rows_by_position(names, folders, rows)
    return found


def to_rows(
    choice: VocabularyChoice | None,
    names: Sequence[str],
    models: list[LoadedModel],
    folders: Sequence[Path],
    *,
    data: bool,
) -> tuple[list[LoadedModel], RunVocabulary | None]:
    """``models`` in one vocabulary layout (as they are where their vocabularies agree): the job's
    choice of the output's vocabulary, the models' names and folders, and whether the run aligns
    on ``data`` (refused where the tokenizers cut text differently)."""
    rows = of_choice(choice, folders, names, [embedding_rows_of(lm.model) for lm in models])
    if rows is None:
        return models, None
    if not rows.cut_alike and data:
        raise IncompatibleModelsError(
            "`data`: the models' tokenizers cut text differently (allowed by `allow_different_tokenizers`), so the "
            "same text is other tokens in each model and the activations the strategy compares would not be of one "
            "input; use a data-free strategy (weight-matching, generalized-orthogonal) and remove `data`"
        )
    out = [
        lm
        if rows.layout.unchanged(i) and embedding_rows_of(lm.model) == rows.layout.rows
        else reindex(lm, rows.layout, i, rows.vocabularies[i])
        for i, lm in enumerate(models)
    ]
    rows.tensors = vocab_tensors(out[0].model)
    return out, rows
