"""Errors caused by user input.

The CLI turns any ``TitanError`` into one red line and exit code 2; every other
exception is a programming error and keeps its traceback.
"""


def counted(n: int, noun: str, plural: str = "") -> str:
    """``1 row``, ``2 rows``, ``1,024 rows``: how refusals and reports count things (one place, so that
    no message says "1 rows")."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


class TitanError(Exception):
    """Bad input from the user: a config value, a file, a checkpoint, a layout."""


class ConfigError(TitanError):
    """An unknown key, a wrong type or an impossible value in the job config."""


class DataError(TitanError):
    """A dataset or tokenizer that cannot be found, read or used."""


class CheckpointError(TitanError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose bytes are damaged (checksum mismatch, truncated or missing file): a run
    resuming its own folder falls back to an older step; anything else is refused."""


class ParallelError(TitanError):
    """A parallel layout that does not fit the world size, the model or the device."""


class TrainingDiverged(TitanError):
    """The loss became NaN or infinite."""


class ProfilingError(TitanError):
    """A profiling option that this run cannot honour, or traces that were not written."""


class TraceError(TitanError):
    """A profiler trace or Flight Recorder dump that cannot be read or makes no sense."""


class TorchInternalsError(TitanError):
    """The installed torch lacks (or changed) an internal that a titanctl feature relies on
    (see titanctl._torch_compat): a different torch version than the one titanctl targets."""
