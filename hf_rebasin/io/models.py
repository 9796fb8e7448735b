"""Loading models from local folders with their stock transformers class.

Checks happen before transformers sees the files (`io.checks`), so that a user mistake becomes a
typed error that names the file or the tensor instead of a load report and a RuntimeError.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.core.errors import CheckpointError, ConfigError, IncompatibleModelsError, RebasinUserError
from hf_rebasin.core.lazy import LazyState, shape_of
from hf_rebasin.core.names import DEVICE_PATTERN
from hf_rebasin.io.checkpoint import Checkpoint, checkpoint_shapes
from hf_rebasin.io.checks import check_checkpoint, check_finite, check_same_shapes
from hf_rebasin.io.configs import config_dtype, model_class, read_config, require_config
from hf_rebasin.io.gate import check_folder
from hf_rebasin.io.renames import Renamer
from hf_rebasin.io.tensors import CheckpointSource, checkpoint_entries
from hf_rebasin.io.ties import read_ties
from hf_rebasin.symmetry.adapters import get_adapter
from hf_rebasin.symmetry.graph import SymmetryGraph

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class LoadedModel:
    """A loaded model (float32 for every computation), its symmetry graph and folder.

    ``stored_dtype`` is the dtype of its floating weights on disk: what an output written from
    it is cast back to (a bf16 Hub model stays bf16), read without loading a weight; ``stored_dtypes``
    has each floating tensor's own (float32 norms beside bf16 matrices). ``ignored``: tensors of
    the files that stock ``from_pretrained`` drops on load (legacy buffers), with the reason. A *streamed*
    model has a ``source`` (its tensors read from disk when used) and a ``model`` whose parameters
    are on the meta device: its class, config and shapes, for `offload.offloaded` forward passes.
    ``expert_layout``: how its files store a mixture of experts' expert tensors (``per-expert`` or
    ``fused``, `Checkpoint.expert_layout`), the layout an output written from it keeps.
    ``embedded``: set when the run wrote it into a wider model's shape (models of different widths).
    ``untied``: the pairs (alias -> source) its config ties but its files store with other values,
    read untied as transformers loads them (`io.ties`); its config then says so.
    """

    model: PreTrainedModel
    graph: SymmetryGraph
    path: Path
    stored_dtype: torch.dtype = torch.float32
    source: LazyState | None = None  # a checkpoint's tensors (`CheckpointSource`), or a view of them
    ignored: dict[str, str] = field(default_factory=dict)  # checkpoint key -> why loading drops it
    stored_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # model name -> dtype on disk (floating)
    expert_layout: str | None = None  # a mixture of experts' files: "per-expert" or "fused" (None: no experts)
    embedded: str | None = None  # written into a wider model's shape for this run: what grew (`run.widths`)
    untied: dict[str, str] = field(default_factory=dict)  # tied by config.json, stored apart: alias -> source
    # tensors its files lack that transformers initialises on load (a pooler, a task head): name -> what;
    # they are zeros here, so that weight-based matching reads nothing from them
    initialised: dict[str, str] = field(default_factory=dict)

    def own_dtypes(self, main: torch.dtype) -> dict[str, torch.dtype]:
        """The tensors stored in a dtype other than ``main`` (that hf-rebasin writes), to write them as stored."""
        return {name: d for name, d in self.stored_dtypes.items() if d != main and d in WRITABLE_DTYPES}

    @property
    def weights(self) -> Mapping[str, Tensor]:
        """Its tensors by name: read from disk one at a time when streamed, else the module's."""
        return self.source if self.source is not None else self.model.state_dict()


# dtypes an output is written in; another stored dtype (float8) is written as float32
WRITABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def load_model(
    path: str | Path,
    *,
    allow_pickle: bool = False,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    stream: bool = False,
    device: torch.device | None = None,
) -> LoadedModel:
    """Load a model folder with its stock class, after checking every tensor against the config.

    ``trust_remote_code`` accepts a folder whose files name their own code (the code is never run:
    the stock class of the model_type is used). ``stream`` loads no weight: the model reads its
    tensors from its safetensors files when they are used (see `LoadedModel`), onto ``device``; a
    pickle checkpoint, or one that transformers converts while loading (other than by stacking
    experts stored one by one), is loaded whole instead.
    """
    from hf_rebasin.io.remote_code import refuse_remote_code

    folder = Path(path)
    require_config(folder)  # the folder and its config.json named first when they are missing
    check_folder(folder, allow_pickle=allow_pickle)  # every file loading reads, before any is read
    refuse_remote_code(folder, trusted=trust_remote_code)
    config = read_config(folder)
    spec = get_adapter(getattr(config, "model_type", None))
    try:
        cls = model_class(config)
    except ConfigError as e:
        raise ConfigError(f"{str(folder)!r}: {e}") from None
    checkpoint = checkpoint_shapes(folder, allow_pickle)
    names, ignored = check_checkpoint(folder, cls, config, checkpoint)
    # tensors the class makes on load (Marian's sinusoidal tables) exist only in a model it built
    if (
        stream
        and checkpoint.files
        and not checkpoint.made
        and not checkpoint.initialised
        and all(f.endswith(".safetensors") for f in checkpoint.files.values())
    ):
        streamed = _streamed(folder, cls, config, checkpoint, names, device)
        if streamed is not None:
            streamed.ignored = ignored
            check_finite(folder, streamed.weights, names, checkpoint)
            return streamed
    model = _from_pretrained(folder, cls, dtype, checkpoint)
    check_finite(folder, model.state_dict(), names, checkpoint)
    state_dict = model.state_dict()
    with torch.no_grad():  # random values carry nothing: as zeros no matching reads them as evidence
        for name in checkpoint.initialised:
            state_dict[name].zero_()
    untied = read_ties(model, names, state_dict)  # before the graph: it reads the ties from the config
    graph = spec.graph(model.config, state_dict.keys())
    graph.check(state_dict, source=str(folder))
    return _loaded(model, graph, folder, checkpoint, names, ignored=ignored, untied=untied)


def _from_pretrained(
    folder: Path, cls: type[PreTrainedModel], dtype: torch.dtype, checkpoint: Checkpoint
) -> PreTrainedModel:
    """``cls.from_pretrained`` on a checked folder, in eval mode: its load report read again, as a
    second line of defence behind `check_checkpoint`, so that a tensor it missed is still an error."""
    prev = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        loaded: Any = cls.from_pretrained(str(folder), dtype=dtype, trust_remote_code=False, output_loading_info=True)
        model: PreTrainedModel = loaded[0]
        info: dict[str, Any] = loaded[1]
    except RuntimeError as e:  # size mismatches under renamed keys
        raise CheckpointError(f"{str(folder)!r}: the weights do not match config.json: {e}") from None
    finally:
        logging.getLogger("transformers").setLevel(prev)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    allowed = tied | checkpoint.made | set(checkpoint.initialised)
    missing = [k for k in info.get("missing_keys", ()) if k not in allowed]
    if missing or info.get("mismatched_keys"):
        first = missing[0] if missing else info["mismatched_keys"][0]
        raise CheckpointError(
            f"{str(folder)!r}: tensor {first!r} is missing from the checkpoint or does not match config.json"
        )
    unexpected = sorted(set(info.get("unexpected_keys", ()) or ()) - checkpoint.dropped)
    if unexpected:  # a second line of defence behind check_checkpoint
        raise CheckpointError(
            f"{str(folder)!r}: the checkpoint holds tensor {unexpected[0]!r}, which a {cls.__name__} with this "
            "config.json does not have"
        )
    model.eval()
    return model


def _loaded(
    model: PreTrainedModel,
    graph: SymmetryGraph,
    folder: Path,
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    **extra: Any,
) -> LoadedModel:
    """The `LoadedModel` of a checked checkpoint: the dtypes and the expert layout its files store."""
    stored = checkpoint.stored_dtype(checkpoint.keys_of(names)) or config_dtype(folder) or torch.float32
    return LoadedModel(
        model,
        graph,
        folder,
        stored,
        stored_dtypes=checkpoint.floating(names),
        expert_layout=checkpoint.expert_layout,
        initialised=dict(checkpoint.initialised),
        **extra,
    )


def _streamed(
    folder: Path,
    cls: type[PreTrainedModel],
    config: Any,
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    device: torch.device | None,
) -> LoadedModel | None:
    """The model as a tensor source over its files and a meta-device module; None when
    transformers would convert tensors while loading (renaming and the stacking of experts stored
    one by one are followed here)."""
    from hf_rebasin.io.offload import empty_model

    model = empty_model(cls, config)
    if Renamer(model).converts(checkpoint.shapes):
        return None
    files = sorted({folder / f for f in checkpoint.files.values()})
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    meta = model.state_dict()
    order = list(meta)
    aliases = {alias: source for alias, source in tied.items() if alias in order and alias not in names}
    source = CheckpointSource(
        folder,
        checkpoint_entries(files),
        {n: k for n, k in names.items() if n not in checkpoint.stacks},
        aliases=aliases,
        order=order,
        device=device,
        stacks=checkpoint.stacks,
    )
    untied = read_ties(model, names, source)  # as from_pretrained would: a pair stored apart is not tied
    spec = get_adapter(getattr(config, "model_type", None))
    graph = spec.graph(model.config, order)
    graph.check(meta, source=str(folder))  # shapes only: the parameters are on meta
    return _loaded(model, graph, folder, checkpoint, names, source=source, untied=untied)


def to_device(model: Any, device: torch.device) -> None:
    """``model.to(device)`` in place (transformers' typing of ``.to`` does not take a device)."""
    model.to(device)


def resolve_device(name: str | None, where: str = "`device`") -> torch.device:
    """``auto`` is CUDA when there is one, else the CPU; a device asked for but absent is a user error."""
    name = name or "auto"
    if not DEVICE_PATTERN.fullmatch(name):
        raise RebasinUserError(f"{where}: {name!r} is not a device; allowed: auto, cpu, cuda, cuda:N, mps")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RebasinUserError(f"{where}: {name!r} was asked for, but no CUDA device is available here")
    if name == "mps" and not torch.backends.mps.is_available():
        raise RebasinUserError(f"{where}: 'mps' was asked for, but MPS is not available here")
    return torch.device(name)


def depth_of(lm: LoadedModel) -> int:
    """The model's number of layers (its text model's; 0 where the config names none)."""
    config = lm.model.config.get_text_config()
    return int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0)


def decoder_depth(config: Any) -> int | None:
    """An encoder-decoder's decoder layers (BART's ``decoder_layers``, T5's ``num_decoder_layers``)."""
    found = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None)
    return int(found) if found is not None else None


def stack_depths(lm: LoadedModel) -> tuple[int, ...]:
    """The layers of each stack the model's graph runs (an encoder-decoder's encoder, then decoder);
    one stack: its depth alone."""
    if len(lm.graph.stacks) > 1:
        return depth_of(lm), decoder_depth(lm.model.config) or 0
    return (depth_of(lm),)


def check_stack_depths(a: LoadedModel, b: LoadedModel) -> None:
    """Encoder-decoders are merged, aligned and transported at one depth in each stack (layer i
    with layer i); `hf-rebasin lineage` alone maps each stack's layers across depths."""
    if not getattr(a.model.config, "is_encoder_decoder", False):
        return
    depths = [(depth_of(lm), decoder_depth(lm.model.config)) for lm in (a, b)]
    if depths[0] != depths[1]:
        (enc_a, dec_a), (enc_b, dec_b) = depths
        raise IncompatibleModelsError(
            f"{str(b.path)!r} has {enc_b} encoder and {dec_b} decoder layers but the reference "
            f"{str(a.path)!r} has {enc_a} and {dec_a}: encoder-decoders are merged, aligned and transported "
            "at one depth (layer i with layer i in each stack). `hf-rebasin lineage A B` maps each stack's layers "
            "across depths (which layers of one model are which of the other): copy those layers into a model of "
            "the other's depths, then merge or transport that model instead"
        )


def label_counts(a: LoadedModel, b: LoadedModel) -> tuple[int, int] | None:
    """The label counts of two classifiers whose task heads differ in shape (a head over 2 labels,
    one over 5), or None: what differs is the task, not the size, so only their bodies (the tensors
    under ``base_model_prefix``) can be compared; each loads with its stock class."""
    labels = [getattr(lm.model.config, "num_labels", None) for lm in (a, b)]
    prefix = f"{getattr(a.model, 'base_model_prefix', '')}."
    if labels[0] == labels[1] or prefix == "." or a.model.base_model is a.model or b.model.base_model is b.model:
        return None
    if prefix != f"{getattr(b.model, 'base_model_prefix', '')}.":
        return None
    head = [n for n in a.weights if not n.startswith(prefix) and n in b.weights]
    if all(shape_of(a.weights, n) == shape_of(b.weights, n) for n in head):
        return None
    return int(labels[0] or 0), int(labels[1] or 0)


def _check_labels(a: LoadedModel, b: LoadedModel) -> None:
    """Heads over other label sets cannot be averaged nor moved onto each other: refused, saying why."""
    labels = label_counts(a, b)
    if labels is None:
        return
    raise IncompatibleModelsError(
        f"the task heads differ: {str(a.path)!r} has {labels[0]} labels and {str(b.path)!r} has {labels[1]}. Heads "
        f"over other label sets cannot be averaged nor moved onto each other; align or merge their bodies instead "
        f"(each loaded as the bare model: `architectures: [{type(a.model.base_model).__name__}]` in a copy of its "
        "config.json). `hf-rebasin lineage` compares such classifiers on their bodies as they are"
    )


def check_compatible(a: LoadedModel, b: LoadedModel) -> None:
    """``b`` can be aligned to ``a``: same model type, class and tensor shapes."""
    type_a, type_b = a.model.config.model_type, b.model.config.model_type
    cls_a, cls_b = type(a.model).__name__, type(b.model).__name__
    if type_a != type_b or cls_a != cls_b:
        raise IncompatibleModelsError(
            f"{str(b.path)!r} is a {cls_b} (model_type {type_b!r}) but the reference {str(a.path)!r} is a "
            f"{cls_a} (model_type {type_a!r}): only models of one architecture can be aligned"
        )
    check_stack_depths(a, b)
    depth_a, depth_b = depth_of(a), depth_of(b)
    if depth_a != depth_b:
        raise IncompatibleModelsError(
            f"{str(b.path)!r} has {depth_b} layers but the reference {str(a.path)!r} has {depth_a}: merge and "
            "transport work on models of one depth (layer i with layer i). `hf-rebasin lineage A B` finds which layers "
            "descend from which (pruned, up-scaled, stacked) and prints a mergekit passthrough config that builds "
            "the parent's layers at the other's depth; merge or transport that model instead"
        )
    _check_labels(a, b)
    check_same_shapes(a.weights, b.weights, repr(str(a.path)), repr(str(b.path)))
    tied_a = dict(getattr(a.model, "all_tied_weights_keys", None) or {})
    tied_b = dict(getattr(b.model, "all_tied_weights_keys", None) or {})
    if set(tied_a) != set(tied_b):
        # the merge and the alignment work in A's form: a tensor tied in A but not in B would drop B's copy
        name = sorted(set(tied_a) ^ set(tied_b))[0]
        tied, untied = (a, b) if name in tied_a else (b, a)
        source = (tied_a if name in tied_a else tied_b)[name]

        def setting(lm: LoadedModel) -> str:
            if lm.untied:  # its config.json says true: say why it was read untied
                return "tie_word_embeddings: true, but its files store the two with other values, so it loads untied"
            value = getattr(lm.model.config.get_text_config(), "tie_word_embeddings", None)
            return f"tie_word_embeddings: {str(value).lower()}"

        raise IncompatibleModelsError(
            f"tensor {name!r} is tied to {source!r} in {str(tied.path)!r} ({setting(tied)}) but stored on its own "
            f"in {str(untied.path)!r} ({setting(untied)}); aligned in one form, the other model's {name} would be "
            "lost. Align models that tie their weights alike (save both with the same tie_word_embeddings)"
        )
