"""Evaluation data from a recipe's ``data`` section, materialised once as batches of tensors.

A barrier curve evaluates the same data at 21 weights λ, so the data are read, tokenized (or
image-processed) and, for masked LM, masked exactly once: every function here returns a list of
ready batches (dicts of model keyword arguments, the form `hf_rebasin.evaluation.evaluate` consumes), and
the masks of a masked-LM set are drawn from a seeded generator so that every λ (and every rerun)
sees the same masked positions.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import io
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import DataError
from hf_rebasin.core.names import (
    BUILTIN_DATASETS,
    DEFAULT_SAMPLE_BY,
    LOCAL_BUILDERS,
    SAMPLE_BY,
    ClassificationTask,
    TextTask,
)
from hf_rebasin.io.datafiles import check_files, has_glob, is_folder

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

# keys of a recipe's data section that this module reads (max_tokens is text_batches' argument)
SPEC_KEYS: tuple[str, ...] = (
    "dataset",
    "name",
    "revision",
    "data_files",
    "data_dir",
    "split",
    "column",
    "label_column",
    "image_column",
    "source_column",
    "target_column",
    "audio_column",
    "max_examples",
    "max_tokens",
    "sample_by",
)
# builders whose files are UTF-8 text: refused up front when empty, binary or not UTF-8
TEXT_BUILDERS: tuple[str, ...] = ("text", "json", "csv")
PARAGRAPH_BREAK = "\n\n"  # what `sample_by: paragraph` splits on (and the builder drops)
_SCAN_CHUNK = 1 << 20
MLM_PROBABILITY = 0.15  # BERT: 15 % of positions predicted, of which 80 % [MASK], 10 % random, 10 % kept
_TOKENIZE_CHUNK = 1000  # texts per tokenizer call (lets max_tokens stop early on large corpora)


# ---------------------------------------------------------------------------------------------
# Loading


def _where(spec: Mapping[str, Any]) -> str:
    where = [f"{k} {spec[k]!r}" for k in ("data_files", "data_dir") if spec.get(k) is not None]
    return f"{spec.get('dataset')!r}" + (f" ({', '.join(where)})" if where else "")


def _files(kwargs: Mapping[str, Any]) -> list[Path]:
    """Every file that ``data_files`` / ``data_dir`` (absolute, as `check_files` made them) name."""
    entries: list[str] = []
    data_files = kwargs.get("data_files")
    if isinstance(data_files, str):
        entries.append(data_files)
    elif isinstance(data_files, Mapping):
        entries.extend(f for v in data_files.values() for f in ([v] if isinstance(v, str) else v))
    elif isinstance(data_files, Sequence):
        entries.extend(data_files)
    out: list[Path] = []
    for entry in entries:
        out.extend(Path(p) for p in sorted(glob.glob(entry, recursive=True)) if has_glob(entry))
        if not has_glob(entry):
            out.append(Path(entry))
    if kwargs.get("data_dir") is not None:
        out.extend(p for p in sorted(Path(kwargs["data_dir"]).rglob("*")) if not p.name.startswith("."))
    return [p for p in dict.fromkeys(out) if p.is_file()]


def check_text_file(path: Path) -> None:
    """Refuse a data file the text builders would choke on (or read as garbage): empty, NUL or other
    binary bytes, not UTF-8. Reads the file once, in chunks, so a large corpus costs one pass."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line, empty = 0, 1, True
    try:
        with path.open("rb") as f:
            while chunk := f.read(_SCAN_CHUNK):
                empty = False
                nul = chunk.find(b"\x00")
                if nul >= 0:
                    at = line + chunk.count(b"\n", 0, nul)
                    raise DataError(
                        f"data file {str(path)!r} holds a NUL byte (line {at}, byte {offset + nul}): it is binary, "
                        "not UTF-8 text; give a text file"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    at = line + chunk.count(b"\n", 0, max(e.start, 0))
                    raise DataError(
                        f"data file {str(path)!r} is not UTF-8 text (line {at}, byte {offset + e.start}: {e.reason}); "
                        "convert it to UTF-8"
                    ) from None
                offset += len(chunk)
                line += chunk.count(b"\n")
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text: it ends inside a character ({e.reason})") from None
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read: {e}") from None
    if empty:
        raise DataError(f"data file {str(path)!r} is empty: give a file with data, or remove it from the list")


def _json_problem(files: Sequence[Path]) -> str | None:
    """Where the first JSON-lines file with a line that is not a JSON value breaks (None: none does)."""
    for path in files:
        if path.suffix.lower() not in (".jsonl", ".ndjson"):
            continue
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    json.loads(raw)
                except ValueError as e:
                    return f"data file {str(path)!r}, line {number}, is not valid JSON ({e})"
    return None


def _load(dataset: str, kwargs: dict[str, Any], split: str | None, where: str) -> Any:
    """`datasets.load_dataset`, with its lookup and parse failures turned into DataError."""
    import datasets
    from datasets.exceptions import DataFilesNotFoundError, DatasetBuildError, DatasetNotFoundError

    try:
        return datasets.load_dataset(dataset, split=split, **kwargs)
    except (DatasetNotFoundError, DataFilesNotFoundError, FileNotFoundError, ConnectionError) as e:
        hint = "" if dataset in LOCAL_BUILDERS else f"; local builders are {', '.join(LOCAL_BUILDERS)}"
        raise DataError(f"cannot load dataset {where}: {e}{hint}") from e
    except DatasetBuildError as e:  # a file the builder cannot parse: name it, and the line when we can
        problem = _json_problem(_files(kwargs)) if dataset == "json" else None
        cause = e.__cause__ or e.__context__
        detail = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else _first_line(e)
        raise DataError(f"cannot read dataset {where}: {problem or detail}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def load_records(spec: Mapping[str, Any], base_dir: Path) -> datasets.Dataset:
    """One split of the data a recipe names (``evaluate.data`` or ``data``), checked up front.

    ``spec`` keys: ``dataset`` (a `datasets` builder such as ``text``/``json``/``csv``/
    ``imagefolder``, a Hub dataset id or a local dataset folder), ``data_files`` (a path, glob,
    list or {split: paths}) and ``data_dir`` (relative paths resolve against ``base_dir``, the
    recipe's folder), ``name``, ``revision``, ``split`` (default ``train``), ``column``,
    ``label_column``, ``image_column`` (each must exist), ``max_examples`` (keep the first n),
    ``sample_by`` (the ``text`` builder only, see `text_options`).
    Keys set to None count as absent, so a pydantic ``model_dump()`` can be passed as is.
    """
    given = {k: v for k, v in spec.items() if v is not None}
    unknown = sorted(set(given) - set(SPEC_KEYS))
    if unknown:
        raise DataError(f"unknown data key(s) {', '.join(unknown)}; expected some of {', '.join(SPEC_KEYS)}")
    dataset = given.get("dataset")
    if not isinstance(dataset, str) or not dataset:
        raise DataError(f"data needs `dataset`: a builder ({', '.join(LOCAL_BUILDERS)}) or a Hub dataset id")
    split = given.get("split", "train")
    if not isinstance(split, str) or not split:
        raise DataError(f"`split` must be a split name such as 'train', not {split!r}")
    sample_by = given.pop("sample_by", None)
    options = text_options(dataset, sample_by)
    if dataset in BUILTIN_DATASETS:
        return _checked(builtin_records(dataset, given.get("name"), split, given), given, repr(dataset))
    base_dir = Path(base_dir)
    kwargs = check_files(given.get("data_files"), given.get("data_dir"), base_dir)
    if dataset in LOCAL_BUILDERS and not kwargs:
        raise DataError(f"dataset {dataset!r} reads local files: set `data_files` (a path or a list) or `data_dir`")
    if dataset not in LOCAL_BUILDERS and is_folder(base_dir / dataset):
        dataset = str((base_dir / dataset).absolute())  # a local dataset folder, relative to the recipe
    if dataset in TEXT_BUILDERS:
        for path in _files(kwargs):
            check_text_file(path)
    if dataset in ("imagefolder", "audiofolder", "videofolder"):
        kwargs["drop_labels"] = False  # keep the class-folder labels even when there is one class
    for key in ("name", "revision"):
        if key in given:
            kwargs[key] = given[key]
    kwargs.update(options)
    where = _where(given)
    splits = _load(dataset, kwargs, None, where)
    base = split.split("[", 1)[0]
    if base not in splits:
        raise DataError(f"dataset {where} has no split {base!r}; its splits are {', '.join(sorted(splits))}")
    records = splits[split] if base == split else _load(dataset, kwargs, split, where)
    if options.get("sample_by") == "paragraph":
        # the builder drops the blank lines it splits on: put them back, so the joined records are the text
        records = records.map(lambda r: {"text": r["text"] + PARAGRAPH_BREAK}, keep_in_memory=True)
    return _checked(records, given, where)


def text_options(dataset: str, sample_by: Any) -> dict[str, Any]:
    """Keyword arguments of the ``text`` builder: ``sample_by`` (default ``document``), line breaks kept.

    The builder's own default (one record per line, line breaks dropped) scores a model on text with
    no line breaks, which it never saw. ``document``: one record per file, tokenized whole, as a
    tokenizer sees the file; ``line``: one record per line, line break kept (run_clm's
    ``keep_linebreaks``), read in chunks so ``max_tokens`` stops early on a large file;
    ``paragraph``: one record per blank-line-separated paragraph, the blank line put back. Records
    are joined with nothing between them (run_clm's ``group_texts``), so every mode reads the same
    characters. Other builders take no ``sample_by``.
    """
    if sample_by is None:
        return {"sample_by": DEFAULT_SAMPLE_BY, "keep_linebreaks": True} if dataset == "text" else {}
    if sample_by not in SAMPLE_BY:
        raise DataError(f"`sample_by` must be one of {', '.join(SAMPLE_BY)}, not {sample_by!r}")
    if dataset != "text":
        raise DataError(
            f"`sample_by` applies to the `text` builder only, not to {dataset!r}: remove it "
            "(records of json / csv files are read as they are)"
        )
    return {"sample_by": sample_by, "keep_linebreaks": True}


def _checked(records: datasets.Dataset, given: Mapping[str, Any], where: str) -> datasets.Dataset:
    """``records`` with the named columns checked and ``max_examples`` applied."""
    for key in ("column", "label_column", "image_column", "source_column", "target_column"):
        if key in given:
            check_column(records, given[key], key, where)
    if "max_examples" in given:
        n = given["max_examples"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise DataError(f"`max_examples` must be a positive integer, not {n!r}")
        records = records.select(range(min(n, len(records))))
    return records


def builtin_records(
    dataset: str, name: str | None, split: str, given: Mapping[str, Any] | None = None
) -> datasets.Dataset:
    """A split of a data set hf-rebasin ships (`BUILTIN_DATASETS`), built offline in memory.

    The zoo models train on these, so a recipe can evaluate them on exactly their held-out data.
    """
    import datasets

    from hf_rebasin.evaluation import data

    if dataset not in BUILTIN_DATASETS:
        raise DataError(f"{dataset!r} is not a built-in data set; built-in: {', '.join(BUILTIN_DATASETS)}")
    files = [k for k in ("data_files", "data_dir", "revision") if (given or {}).get(k) is not None]
    if files:
        raise DataError(f"the built-in data set {dataset!r} reads no files: remove `{'`, `'.join(files)}`")
    plays_set = dataset in ("shakespeare", "shakespeare-chatml")
    splits = ("train", "test", "all") if plays_set else ("train", "test")
    if split not in splits:
        hint = "; use `max_examples` to read fewer" if "[" in split else ""
        raise DataError(f"the built-in data set {dataset!r} has splits {', '.join(splits)}, not {split!r}{hint}")
    if plays_set:
        plays = [p.strip() for p in name.split(",") if p.strip()] if name else list(data.DEFAULT_PLAYS)
        unknown = sorted(set(plays) - set(data.available_plays()))
        if unknown or not plays:
            raise DataError(
                f"`name`: unknown play(s) {', '.join(unknown) or '(none given)'}; "
                f"available: {', '.join(data.available_plays())}"
            )
        texts = [data.corpus_text(dataset, [play], split=split) for play in plays]  # type: ignore[arg-type]
        return datasets.Dataset.from_dict({"text": texts, "play": plays})
    if name is not None:
        raise DataError(f"the built-in data set {dataset!r} has no configurations: remove `name`")
    from PIL import Image

    images, labels = data.digits_dataset(split)  # type: ignore[arg-type]
    pixels = ((images[:, 0] * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(p) for p in pixels], "label": labels.tolist()}, features=features
    )


def check_column(records: datasets.Dataset, column: str, key: str = "column", where: str = "the data") -> None:
    """Refuse a column the records do not have, listing the ones they do."""
    if column not in records.column_names:
        raise DataError(
            f"{key} {column!r} is not a column of {where}; its columns are {', '.join(records.column_names)}"
        )


# ---------------------------------------------------------------------------------------------
# Language modelling


def _texts(records: datasets.Dataset, column: str) -> Iterator[list[str]]:
    """Non-empty texts of ``column`` in chunks. Whitespace-only texts are kept: a blank line (``"\\n"``
    with line breaks kept) is text the model reads too."""
    check_column(records, column)
    for start in range(0, len(records), _TOKENIZE_CHUNK):
        chunk = records[start : start + _TOKENIZE_CHUNK][column]
        for value in chunk:
            if value is not None and not isinstance(value, str):
                raise DataError(f"column {column!r} must hold text, but holds {type(value).__name__} values")
        yield [t for t in chunk if t]


def _token_stream(
    tokenizer: PreTrainedTokenizerBase, records: datasets.Dataset, column: str, max_tokens: int | None
) -> tuple[Tensor, Tensor]:
    """All texts tokenized (with the tokenizer's own special tokens) and concatenated.

    Returns ``(ids, special)``: int64 ids and a bool mask of special-token positions.
    """
    special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    ids: list[int] = []
    special: list[int] = []
    for texts in _texts(records, column):
        if not texts:
            continue
        enc = tokenizer(texts, return_special_tokens_mask=True, return_attention_mask=False, verbose=False)
        for row, mask in zip(enc["input_ids"], enc["special_tokens_mask"], strict=True):
            ids.extend(row)
            special.extend(mask)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids, special = ids[:max_tokens], special[:max_tokens]
    flat = torch.tensor(ids, dtype=torch.long)
    is_special = torch.tensor(special, dtype=torch.bool) | torch.isin(flat, special_ids)
    return flat, is_special


def _blocks(flat: Tensor, special: Tensor, block_size: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Consecutive ``[n, block_size]`` blocks (ids, attention mask, special mask).

    As run_clm / run_mlm's ``group_texts``, except that a last partial block of at least two
    tokens is kept, right-padded (attention 0, never a label), so a small set loses no text.
    """
    n_full, rest = divmod(flat.numel(), block_size)
    cut = n_full * block_size
    ids = flat[:cut].view(n_full, block_size)
    spec = special[:cut].view(n_full, block_size)
    attn = torch.ones_like(ids)
    if rest >= 2:
        last = torch.full((1, block_size), pad_id, dtype=torch.long)
        last[0, :rest] = flat[cut:]
        last_attn = torch.zeros((1, block_size), dtype=torch.long)
        last_attn[0, :rest] = 1
        last_spec = torch.ones((1, block_size), dtype=torch.bool)
        last_spec[0, :rest] = special[cut:]
        ids, attn, spec = torch.cat([ids, last]), torch.cat([attn, last_attn]), torch.cat([spec, last_spec])
    return ids, attn, spec


def mask_tokens(
    ids: Tensor, candidates: Tensor, *, mask_token_id: int, vocab_size: int, seed: int
) -> tuple[Tensor, Tensor]:
    """BERT masking of ``ids`` at positions ``candidates`` allows: ``(masked ids, labels)``.

    Each candidate is chosen with p = 0.15; of the chosen, 80 % become ``mask_token_id``, 10 % a
    uniformly random token, 10 % stay; labels are the original ids there and -100 elsewhere.
    All draws come from one generator seeded by ``seed``: the same seed gives the same masks.
    """
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(ids.shape, generator=g) < MLM_PROBABILITY) & candidates
    labels = ids.masked_fill(~chosen, -100)
    u = torch.rand(ids.shape, generator=g)
    random_tokens = torch.randint(vocab_size, ids.shape, generator=g, dtype=torch.long)
    out = ids.clone()
    out[chosen & (u < 0.8)] = mask_token_id
    replace = chosen & (u >= 0.8) & (u < 0.9)
    out[replace] = random_tokens[replace]
    return out, labels


def _check_positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise DataError(f"`{name}` must be an integer ≥ {minimum}, not {value!r}")


def text_batches(
    records: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: TextTask,
    column: str = "text",
    block_size: int = 128,
    batch_size: int = 8,
    max_tokens: int | None = None,
    seed: int = 0,
) -> list[dict[str, Tensor]]:
    """Language-model batches ``{"input_ids", "attention_mask", "labels"}``, tokenized once.

    Texts are tokenized, concatenated and cut into ``block_size`` blocks (``max_tokens`` keeps
    the first tokens). Causal LM: labels are the input ids (the model, or `evaluate_loss`,
    shifts them), -100 on padding. Masked LM: `mask_tokens` over non-special, non-pad positions
    with a generator seeded by ``seed``, so every λ of a curve sees the same masks.
    """
    if task not in ("causal-lm", "masked-lm"):
        raise DataError(f"text_batches serves causal-lm and masked-lm, not {task!r}")
    _check_positive("block_size", block_size, 2)
    _check_positive("batch_size", batch_size)
    _check_positive("max_tokens", max_tokens)
    if task == "masked-lm" and tokenizer.mask_token_id is None:
        raise DataError(
            f"masked-lm needs a tokenizer with a mask token, and this {type(tokenizer).__name__} has none; "
            "use the masked-LM model's own tokenizer (or causal-lm for a decoder)"
        )
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    flat, special = _token_stream(tokenizer, records, column, max_tokens)
    ids, attn, spec = _blocks(flat, special, block_size, int(pad_id))
    if ids.shape[0] == 0:
        raise DataError(
            f"column {column!r} gave {flat.numel()} tokens: too few for one block of {block_size}; "
            "add data or lower block_size"
        )
    if task == "causal-lm":
        inputs, labels = ids, ids.masked_fill(attn == 0, -100)
    else:
        inputs, labels = mask_tokens(
            ids,
            (attn == 1) & ~spec,
            mask_token_id=int(tokenizer.mask_token_id),  # type: ignore[arg-type]
            vocab_size=len(tokenizer),
            seed=seed,
        )
    return [
        {"input_ids": inputs[i : i + batch_size], "attention_mask": attn[i : i + batch_size], "labels": lab}
        for i, lab in ((i, labels[i : i + batch_size]) for i in range(0, ids.shape[0], batch_size))
    ]


# ---------------------------------------------------------------------------------------------
# Classification


def _labels(records: datasets.Dataset, label_column: str, label2id: Mapping[str, int] | None) -> Tensor:
    """Integer labels; names (string values, or ClassLabel names when ``label2id`` is given) mapped.

    Without ``label2id``, ClassLabel / integer values are used as they are.
    """
    check_column(records, label_column, "label_column")
    values = list(records[label_column])
    feature = records.features.get(label_column)
    names: list[str] | None = getattr(feature, "names", None)
    if label2id is not None and names is not None:
        values = [names[v] for v in values]
    if any(isinstance(v, str) for v in values):
        if label2id is None:
            raise DataError(
                f"label_column {label_column!r} holds names (e.g. {next(v for v in values if isinstance(v, str))!r}): "
                "pass label2id (the model config's label2id) to map them to class ids"
            )
        unknown = sorted({v for v in values if v not in label2id}, key=str)
        if unknown:
            raise DataError(
                f"label {unknown[0]!r} in column {label_column!r} is not one of the model's labels "
                f"({', '.join(map(str, label2id))}){f'; {len(unknown)} unknown in all' if len(unknown) > 1 else ''}"
            )
        return torch.tensor([label2id[v] for v in values], dtype=torch.long)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise DataError(f"label_column {label_column!r} must hold class ids or names, not {v!r}")
    if label2id is not None:
        known = set(label2id.values())
        bad = sorted({v for v in values if v not in known})
        if bad:
            raise DataError(
                f"label {bad[0]} in column {label_column!r} is not a class id of the model ({sorted(known)})"
            )
    return torch.tensor(values, dtype=torch.long)


def classification_batches(
    records: datasets.Dataset,
    processor: Any,
    *,
    task: ClassificationTask,
    column: str | Sequence[str] = "text",
    image_column: str = "image",
    label_column: str = "label",
    batch_size: int = 32,
    label2id: Mapping[str, int] | None = None,
    max_length: int | None = None,
    image_mode: str | None = None,
) -> list[dict[str, Tensor]]:
    """Classification batches with ``labels``, tokenized / image-processed once.

    sequence-classification: ``processor`` is a tokenizer; ``column`` is one text column or two
    (a sentence pair), padded per batch and truncated to ``max_length`` (default: the tokenizer's
    limit). image-classification: ``processor`` is an image processor applied to
    ``image_column`` (converted to ``image_mode``, e.g. ``"RGB"``, when given). String labels go
    through ``label2id``; an unknown label is an error that names it.
    """
    if task not in ("sequence-classification", "image-classification"):
        raise DataError(f"classification_batches serves sequence- and image-classification, not {task!r}")
    _check_positive("batch_size", batch_size)
    _check_positive("max_length", max_length)
    labels = _labels(records, label_column, label2id)
    if len(records) == 0:
        raise DataError("the evaluation data hold no examples")
    out: list[dict[str, Tensor]] = []
    if task == "sequence-classification":
        columns = [column] if isinstance(column, str) else list(column)
        if not 1 <= len(columns) <= 2:
            raise DataError(f"`column` must name one text column or two (a pair), not {columns!r}")
        for c in columns:
            check_column(records, c)
        if getattr(processor, "pad_token_id", None) is None:
            raise DataError(f"the tokenizer ({type(processor).__name__}) has no pad token; set its pad_token first")
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            texts = [chunk[c] for c in columns]
            enc = processor(
                *texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt", verbose=False
            )
            out.append({**{k: v for k, v in enc.items()}, "labels": labels[start : start + batch_size]})
    else:
        check_column(records, image_column, "image_column")
        for start in range(0, len(records), batch_size):
            try:
                with _strict_images():
                    images = records[start : start + batch_size][image_column]
                    if image_mode is not None:
                        images = [im.convert(image_mode) for im in images]
            except _IMAGE_ERRORS as e:
                raise DataError(_bad_image(records, image_column, range(start, start + batch_size), e)) from None
            pixels = processor(images=images, return_tensors="pt")["pixel_values"]
            out.append({"pixel_values": pixels, "labels": labels[start : start + batch_size]})
    return out


def _image_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image

    # OSError: unidentified or truncated files; SyntaxError / ValueError: some PIL plugins on
    # malformed headers; the bomb checks (the warning is raised as an error in `_strict_images`)
    return (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning)


_IMAGE_ERRORS = _image_errors()


@contextlib.contextmanager
def _strict_images() -> Iterator[None]:
    """PIL's decompression-bomb warning (an image of more than ``MAX_IMAGE_PIXELS``) as an error: an
    image that large is an attack or a mistake, never evaluation data for these models."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def _bad_image(records: datasets.Dataset, column: str, rows: range, error: BaseException) -> str:
    """What is wrong with the first image of ``rows`` PIL cannot decode, naming its file."""
    import datasets
    from PIL import Image

    raw = records.select(range(rows.start, min(rows.stop, len(records)))).cast_column(
        column, datasets.Image(decode=False)
    )
    for i, item in enumerate(raw[column]):
        path = (item or {}).get("path") or f"row {rows.start + i}"
        try:
            with _strict_images():
                source = item.get("bytes") or item.get("path")
                with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
                    im.load()
        except _IMAGE_ERRORS as e:
            return f"image_column {column!r}: the image {path!r} cannot be used: {_image_reason(e)}"
    return f"image_column {column!r}: an image of rows {rows.start}..{rows.stop - 1} cannot be used: {_image_reason(error)}"


def _image_reason(e: BaseException) -> str:
    from PIL import Image

    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"{_first_line(e)} (refused: a decompression bomb, or far larger than any model input)"
    return f"{type(e).__name__}: {_first_line(e)} (a corrupt or truncated file, or not an image)"
