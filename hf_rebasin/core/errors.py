"""Typed errors.

Every error a user can cause derives from :class:`RebasinUserError`; the CLI turns those into a
one-paragraph message and exit code 2. Anything else is a bug in hf-rebasin (exit code 1).
Messages say what is wrong, where (file, field, tensor) and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class RebasinError(Exception):
    """Base class of every error raised on purpose by hf-rebasin."""


class RebasinUserError(RebasinError):
    """A problem with the user's input: exit code 2, no traceback."""


class DataError(RebasinUserError, ValueError):
    """Data that cannot be read or used: missing file, unknown column, split, label or play, bad size."""


class ModelNotFoundError(RebasinUserError, OSError):
    """A model reference points at nothing usable (missing folder, missing config.json)."""


class CheckpointError(RebasinUserError, ValueError):
    """A checkpoint does not match its config (shape, missing or extra tensors)."""


class ConfigError(RebasinUserError, ValueError):
    """config.json describes no model: an impossible dimension, or `architectures` naming something
    that is not a model class of its model_type."""


class FunctionNotPreservedError(RebasinError):
    """An alignment changed the aligned model's outputs past the tolerance (or to NaN/Inf): a bug in
    hf-rebasin (exit code 1), reported before anything is written."""


class PickleRefusedError(RebasinUserError, ValueError):
    """A checkpoint is only available as pickle (.bin) and pickle was not allowed."""


class TokenizerError(RebasinUserError, ValueError):
    """A model's tokenizer files that do not load, or a tokenizer with token ids past the model's
    embedding matrix (the first such token would crash the model). ``reason``: the loader's reason
    in one line, without the folder's path (notes that go into a published card quote it)."""

    reason: str = ""


class UnsupportedArchitectureError(RebasinUserError, ValueError):
    """`config.model_type` has no adapter."""


class IncompatibleModelsError(RebasinUserError, ValueError):
    """Two models that should share an architecture do not (names the first differing tensor)."""


class TransformError(RebasinUserError, ValueError):
    """A transform that is not allowed for a space, or that needs the canonical form first."""


class PinnedSpaceError(TransformError):
    """A map other than the identity on a pinned space (a stream a table regenerated on load writes)."""


class OutputExistsError(RebasinUserError, FileExistsError):
    """The output folder exists already (nothing is overwritten without being asked)."""


class OutputPathError(RebasinUserError, ValueError):
    """An output folder that overlaps an input (is, contains or lies inside it) or cannot be written."""


class OutputBusyError(RebasinUserError, BlockingIOError):
    """Another hf-rebasin run holds the lock of the same output folder."""


class OutputWriteError(RebasinUserError, OSError):
    """The output could not be written (disk full, quota, file too large); nothing was replaced."""


class StrategyOptionError(RebasinUserError, ValueError):
    """A strategy name or option that does not exist or does not apply to the models at hand."""


class MetricError(RebasinUserError, ValueError):
    """An `evaluate.metrics` entry that does not load, or fails on (or does not fit) the task's predictions."""


class MissingDataError(RebasinUserError, ValueError):
    """A strategy (or one of its options) needs alignment data and none was given."""


class AdapterError(RebasinError):
    """An adapter does not describe the model it was given: a bug in hf-rebasin (exit code 1)."""


class UnreadableFileError(RebasinUserError, OSError):
    """A file hf-rebasin will not open: a link out of its model's folder or a link loop, a FIFO or
    a device (reading blocks or never ends), or a size no such file has."""


class UserPathError(RebasinUserError, OSError):
    """A path the user gave that the file system will not look up: a name longer than it allows, a
    folder on the way without permission, a file where a folder should be. Found where the path is
    first used, so that no `OSError` from it reaches the user as an internal error."""


class FileFormatError(RebasinUserError, ValueError):
    """A model folder's file is not what its name says: not JSON, or JSON of the wrong shape
    (tokenizer, generation or processor configs)."""


def prefixed(message: str, where: str) -> bool:
    """Whether ``message`` starts with ``where:`` already (it names its field or argument)."""
    return message.startswith(f"{where}: ")


def unprefixed(message: str, where: str) -> str:
    """``message`` without a leading ``where:``, for quoting an error inside another that names ``where``."""
    return message[len(where) + 2 :] if prefixed(message, where) else message


@contextmanager
def named(where: str | None, *, unless_named: bool = False) -> Iterator[None]:
    """User errors raised inside start with ``where`` (a recipe field, a flag): the same type, so
    the exit code stays. A message that starts with ``where`` already is left as it is (named
    regions nest: a command's argument around a loader that names it too). ``unless_named``: one
    that names a field already (starts with a backtick) is left as it is. ``where=None`` changes
    nothing."""
    try:
        yield
    except RebasinUserError as e:
        message = str(e)
        if where is None or prefixed(message, where) or (unless_named and message.startswith("`")):
            raise
        raise type(e)(f"{where}: {message}") from None
