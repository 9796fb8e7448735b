"""Two models written in one basis: what ``hf-rebasin align --output`` leaves for other tools.

A merge tool (mergekit's SLERP or TIES, a notebook) averages tensors by name; it can only merge
two independently trained models once they are in one basis. ``align`` writes both: ``a/`` is model
A (in canonical form when the strategy used one: LayerNorm scales folded into the next weights, a
tied head stored apart) and ``b/`` is model B moved into A's basis. Each is a stock model folder
with its own tokenizer and support files, and each computes what its input computed: checked on
fixed example inputs before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin import __version__
from hf_rebasin.alignment.verify import check_preserved, example_gap, tolerance
from hf_rebasin.io.checkpoint import dtype_name
from hf_rebasin.io.export import copy_support_files, save_merged_model
from hf_rebasin.io.hub.resolve import is_path
from hf_rebasin.io.models import WRITABLE_DTYPES, LoadedModel
from hf_rebasin.io.output import output_folder, write_json, write_text
from hf_rebasin.io.rebuild import rebuilt
from hf_rebasin.symmetry.embed import Embedding

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hf_rebasin.alignment.strategies import Alignment
    from hf_rebasin.symmetry.graph import SymmetryGraph
    from hf_rebasin.symmetry.transforms import Transform


@dataclass(frozen=True)
class Gap:
    """max |Δ logits| between a model and its rewritten form, and max |logits| of the model."""

    max_abs_diff: float
    scale: float

    @property
    def tolerance(self) -> float:
        return tolerance(self.scale)


def function_gap(
    original: PreTrainedModel,
    state_dict: Mapping[str, Tensor],
    untie: bool,
    basis: tuple[SymmetryGraph, Transform] | None = None,
) -> Gap:
    """How far ``original`` rebuilt from ``state_dict`` moves its logits on `verify`'s example inputs;
    a model without a head compares its hidden states, carried into the rebuilt one's ``basis``."""
    return Gap(*example_gap(original, rebuilt(original, state_dict, untie), basis))


def check_gaps(gaps: Mapping[str, Gap]) -> None:
    """An exact alignment that changed a model's outputs is a bug: refused before anything is written."""
    for label, gap in gaps.items():
        check_preserved(gap.max_abs_diff, gap.scale, f"written in one basis, model {label}")


def written_dtype(loaded: LoadedModel) -> torch.dtype:
    """Each model is written as it is stored (the alignment ran in float32)."""
    return loaded.stored_dtype if loaded.stored_dtype in WRITABLE_DTYPES else torch.float32


def write_pair(
    folder: Path,
    models: Mapping[str, tuple[str, LoadedModel]],
    alignment: Alignment,
    aligned_b: Mapping[str, Tensor],
    summary: Mapping[str, Any],
    *,
    inputs: Iterable[tuple[str, Path]],
) -> Path:
    """Write ``a/``, ``b/``, ``alignment.json``, a README and a mergekit config into ``folder`` (a temporary sibling
    renamed when complete; never an input). ``models`` maps ``A``/``B`` to (as given, loaded)."""
    (given_a, a), (given_b, b) = models["A"], models["B"]
    untie = bool(alignment.untied)
    record = {
        **summary,
        "hf_rebasin_version": __version__,
        "models": {
            "A": {"given": given_a, "folder": "a", "dtype": dtype_name(written_dtype(a))},
            "B": {"given": given_b, "folder": "b", "dtype": dtype_name(written_dtype(b))},
        },
        "canonical": alignment.canonical,
        "untied": list(alignment.untied),
    }
    with output_folder(Path(folder), overwrite=False, inputs=inputs, where="--output") as tmp:
        for sub, loaded, state in (("a", a, alignment.sd_a), ("b", b, aligned_b)):
            cpu = {k: v.detach().cpu() for k, v in state.items()}
            dtype = written_dtype(loaded)
            save_merged_model(
                loaded.model.cpu(),
                cpu,
                tmp / sub,
                untie=untie,
                dtype=dtype,
                dtypes=loaded.own_dtypes(dtype),
                expert_layout=loaded.expert_layout,
                leave_out=set(loaded.initialised),  # as its files did: loading initialises them again
            )
            copy_support_files(loaded.path, tmp / sub)
        write_json(tmp / "alignment.json", record)
        write_text(tmp / "README.md", readme(record))
        write_text(tmp / "mergekit.yaml", mergekit_config(record["models"]["A"]["dtype"]))
    return Path(folder)


def mergekit_config(dtype: str) -> str:
    """A mergekit SLERP of ``a/`` and ``b/`` at the midpoint (``./``: mergekit asks the Hub about bare names)."""
    return f"""merge_method: slerp
base_model: ./a
models:
  - model: ./a
  - model: ./b
parameters:
  t: 0.5
dtype: {dtype}
"""


def mergekit_limit(config: Any) -> str | None:
    """What mergekit 0.1.5 is known to refuse among the families it defines (checked with it), said in
    the run's notes rather than found by the user: its T5 definition lists only the gated feed-forward;
    its Whisper definition's decoder prefix lacks a dot."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("t5", "mt5") and not getattr(config, "is_gated_act", True):
        return (
            "mergekit.yaml: mergekit 0.1.5's T5 definition lists only the gated feed-forward (wi_0, wi_1), so it "
            "refuses this ReLU T5 ('Tensor …wi_0.weight required but not present'); a/ and b/ merge tensor by "
            "tensor with any other tool"
        )
    if model_type == "whisper":
        return (
            "mergekit.yaml: mergekit 0.1.5's Whisper definition gives the decoder the prefix 'model.decoder' "
            "without a dot, so it looks for tensors such as 'model.decoderembed_tokens.weight' and refuses "
            "('Tensor model.decoderembed_tokens.weight required but not present'); a/ and b/ merge tensor by "
            "tensor with any other tool"
        )
    return None


def _short(given: str) -> str:
    """A Hub id as it is, a folder by its name (no local absolute path in a file meant to be shared)."""
    return Path(given).name if is_path(given) or Path(given).exists() else given


def readme(record: Mapping[str, Any]) -> str:
    """What the folder holds and how to merge it with another tool."""
    a, b = record["models"]["A"], record["models"]["B"]
    canonical = (
        "in canonical form (LayerNorm scales folded into the next weights"
        + (", " + ", ".join(record["untied"]) + " stored apart" if record["untied"] else "")
        + "): the same function as A, stored differently"
        if record["canonical"]
        else "as it was"
    )
    distance = record["distance"]
    return f"""# {_short(a["given"])} and {_short(b["given"])} in one basis

Written by `hf-rebasin align` with strategy `{record["strategy"]}` (hf-rebasin {record["hf_rebasin_version"]}).

- `a/`: model A, {canonical}.
- `b/`: model B with its heads, units and residual stream moved into A's basis: the same function as B.

Relative distance ‖A − B‖ / ‖A‖: {distance["before"]:.4f} before, {distance["after"]:.4f} after.
Both folders load with the stock `transformers` class and can be merged tensor by tensor by any
tool. With mergekit, in this folder (`mergekit.yaml` is a SLERP at the midpoint):

```
mergekit-yaml mergekit.yaml merged/
```
"""


def write_embedded(
    folder: Path,
    given: tuple[str, str],
    loaded: LoadedModel,
    wide: PreTrainedModel,
    embedding: Embedding,
    *,
    inputs: Iterable[tuple[str, Path]],
) -> Gap:
    """Write ``wide`` (``loaded`` embedded into a wider shape) to ``folder`` as a model folder with
    the narrow model's tokenizer files, ``embedding.json`` and a README saying what was padded; its
    logits are checked against the narrow model's first (nothing is written when they differ).
    ``given``: the narrow model and the wide one as named on the command line."""
    gap = Gap(*example_gap(loaded.model, wide))
    check_preserved(gap.max_abs_diff, gap.scale, "the embedded model")
    dtype = written_dtype(loaded)
    record = {
        "hf_rebasin_version": __version__,
        "model": given[0],
        "like": given[1],
        "dtype": dtype_name(dtype),
        **embedding.as_dict(),
        "function_preserved": {"max_abs_diff": gap.max_abs_diff, "tolerance": gap.tolerance},
    }
    with output_folder(Path(folder), overwrite=False, inputs=inputs, where="--output") as tmp:
        state = {k: v.detach().cpu() for k, v in wide.state_dict().items()}
        save_merged_model(
            wide.cpu(), state, tmp, untie=False, dtype=dtype, dtypes=loaded.own_dtypes(dtype), expert_layout=None
        )
        copy_support_files(loaded.path, tmp)
        write_json(tmp / "embedding.json", record)
        write_text(tmp / "README.md", embedded_readme(record, embedding))
    return gap


def embedded_readme(record: Mapping[str, Any], embedding: Embedding) -> str:
    """The card of an embedded model: what grew and why it computes what the narrow one did."""
    lines = "\n".join(f"- {line}" for line in embedding.describe())
    gap = record["function_preserved"]
    return f"""# {_short(record["model"])} in the shape of {_short(record["like"])}

Written by `hf-rebasin embed` (hf-rebasin {record["hf_rebasin_version"]}): the same function as
{_short(record["model"])}, stored in a wider shape. Every added residual feature, MLP unit and
attention head has zero weights, so nothing reads it and it adds nothing; each norm on the wider
residual stream has its scale multiplied by √(d/d′) (and its ε by d/d′), so it normalises as before.

{lines}

max |Δ logits| against the original on fixed example inputs: {gap["max_abs_diff"]:.2e}
(tolerance {gap["tolerance"]:.0e}). Stored as {record["dtype"]}. It loads with the stock `transformers`
class and can be merged, tensor by tensor, with models of the wide shape (`hf-rebasin` does this
itself when a recipe names models of different widths).
"""
