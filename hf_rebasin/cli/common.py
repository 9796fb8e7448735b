"""What every command shares: exit codes, quiet libraries, model references (folders, zoo
models, Hub ids), ``--set`` options and the recipe shorthand."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from hf_rebasin.core.errors import RebasinUserError

EXIT_OK = 0


EXIT_INTERNAL = 1  # also: verification outside tolerance


EXIT_USER = 2


DEBUG_ENV = "HF_REBASIN_DEBUG"


def quiet_libraries() -> None:
    """Silence transformers/hub logging and progress bars so the CLI prints only its own report.

    Done here (not at import of the library modules) so that users of the Python API keep their own
    logging settings.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - older huggingface_hub
        pass


def quiet_datasets() -> None:
    """Silence `datasets` logging and progress bars (reading local files is not worth a bar). Its
    errors too: a file it cannot read becomes hf-rebasin's own error naming the file and line, and
    `datasets`' line before it ("Failed to load JSON ...") would only repeat it in other words."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from datasets.utils import logging as ds_logging
    except ImportError:  # pragma: no cover - datasets is a dependency
        return
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    ds_logging.disable_progress_bar()


def run_options(parser: argparse.ArgumentParser, output_help: str, output: str | None = None) -> None:
    """``--dry-run``, ``--output``, ``--device``: shared by ``run`` and ``demo``."""
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and print the plan; no weights loaded, nothing trained"
    )
    parser.add_argument("--output", metavar="DIR", default=output, help=output_help)
    parser.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps (overrides `device`)")
    parser.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run even when the estimated peak memory exceeds what is available (the dry run prints the estimate)",
    )


COMMANDS = ("verify", "align", "embed", "lineage", "run", "demo", "zoo", "push", "schema")


DEMO_OUTPUT = "rebasin-demo"


RECIPE_SUFFIXES = (".yaml", ".yml")


def recipe_shorthand(argv: Sequence[str]) -> list[str]:
    """``hf-rebasin RECIPE.yaml ...`` as ``hf-rebasin run RECIPE.yaml ...``.

    A first positional argument that names a sub-command keeps it; otherwise, when a positional
    argument ends in .yaml / .yml (or the first one is an existing file), it is a recipe and ``run``
    is put in front of everything (so ``--output DIR RECIPE.yaml`` works too).
    """
    args = list(argv)
    positionals = [a for a in args if not a.startswith("-")]
    if not positionals or positionals[0] in COMMANDS:
        return args
    if any(a.lower().endswith(RECIPE_SUFFIXES) for a in positionals) or os.path.isfile(positionals[0]):
        return ["run", *args]
    return args


def _model_folder(value: str, allow_pickle: bool, where: str = "MODEL") -> str:
    """A folder as given, a zoo model (``zoo:gpt2-seed0``, trained on first use) or a Hub
    ``id[@revision]`` downloaded (what hf-rebasin reads of it)."""
    from hf_rebasin.io.files import probe
    from hf_rebasin.io.hub.download import download_model
    from hf_rebasin.io.hub.resolve import is_path, is_repo_id, split_ref
    from hf_rebasin.recipe import ZOO_PATTERN

    zoo = ZOO_PATTERN.fullmatch(value)
    if zoo is not None:
        from hf_rebasin.evaluation.zoo.train import cached_model

        return str(cached_model(zoo.group(1), int(zoo.group(2))))
    repo, revision = split_ref(value)
    if probe(value, where) is not None or is_path(value) or not is_repo_id(repo):  # an OSError named, in words
        return value
    try:
        return str(download_model(repo, revision, allow_pickle=allow_pickle, where=where).folder)
    except RebasinUserError as e:
        if "/" in repo:
            raise
        raise type(e)(f"{e}; and there is no local folder {value!r} here (give ./{value} for a folder)") from None


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    from hf_rebasin.core.errors import StrategyOptionError
    from hf_rebasin.recipe.limits import YamlLimitError, load_limited

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StrategyOptionError(f"`--set {item}`: expected KEY=VALUE, e.g. --set max_iter=5")
        try:
            parsed = load_limited(value, "the value")[1]  # nesting and size bounded as a recipe's are
        except YamlLimitError as e:
            raise StrategyOptionError(f"`--set {key.strip()}=...`: {e.message}") from None
        except yaml.YAMLError as e:
            what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
            raise StrategyOptionError(
                f"`--set {item}`: the value of {key.strip()} is not valid YAML ({what or e}); quote it, "
                "e.g. --set name='[1, 2]', or write a number, true/false, a word or a [list]"
            ) from None
        if not _plain_yaml(parsed):
            raise StrategyOptionError(
                f"`--set {item}`: the value of {key.strip()} is a {type(parsed).__name__}; an option is a number, "
                "true/false, a string, or a list or mapping of those"
            )
        out[key.strip()] = parsed
    return out


def _plain_yaml(value: Any) -> bool:
    """Whether a parsed ``--set`` value is plain data (no dates, binary, sets from YAML tags)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain_yaml(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_yaml(v) for k, v in value.items())
    return False
