"""Recipe TOML + `--section.key VALUE` overrides -> a validated JobConfig.

Precedence: command line > TOML > defaults. Every mistake is a ConfigError naming
the key and, for unknown keys, the nearest valid one. Given the running subcommand, an override
that it does not read is refused too (``titanctl.config.commands`` says which keys each one reads).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import posixpath
import types
import typing
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from titanctl.config import commands
from titanctl.config.job_config import MODEL_FLAVORS, SFT, JobConfig
from titanctl.config.user_regex import check_user_regex
from titanctl.errors import ConfigError
from titanctl.safe_io import parse_toml, read_bytes, regular_file_size

MAX_RECIPE_BYTES = 1 << 20  # recipes are a few KiB
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@functools.cache
def _sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return typing.get_type_hints(JobConfig)


@functools.cache
def field_specs() -> dict[str, tuple[Any, dataclasses.Field]]:
    """Every config key as 'section.key' -> (its type, its dataclass field)."""
    specs = {}
    for section, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            specs[f"{section}.{f.name}"] = (hints[f.name], f)
    return specs


def _unknown_key(key: str, where: str) -> ConfigError:
    valid = list(field_specs())
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid sections: {', '.join(_sections())}"
    return ConfigError(f"unknown config key '{key}'{where}{hint}")


def _coerce(key: str, typ: Any, value: Any, from_text: bool) -> Any:
    """Convert a TOML value or command-line text to the field's type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(typ) if t is not type(None)][0]
        if value is None or (from_text and str(value).lower() in ("", "none", "null")):
            return None
        return _coerce(key, inner, value, from_text)
    if origin is list:
        (item,) = typing.get_args(typ)
        if dataclasses.is_dataclass(item):
            return _tables(key, item, value, from_text)
        if from_text:
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(key, item, v, from_text) for v in value]
    name = getattr(typ, "__name__", str(typ))
    bad = ConfigError(f"config key '{key}' expects {name}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise bad
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad
    if typ in (int, float):
        if from_text:
            try:
                return typ(value)
            except ValueError:
                raise bad from None
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (typ is int and not float(value).is_integer()):
            raise bad
        return typ(value)
    raise TypeError(f"unsupported config type {typ} for {key}")


def _tables(key: str, cls: type, value: Any, from_text: bool) -> list:
    """A list of tables (``[[section.key]]`` in a recipe) -> a list of ``cls``. On the command line
    the same list is written as a TOML inline array; an empty value (or none, []) clears it."""
    if from_text:
        text = str(value).strip()
        if text.lower() in ("", "none", "null", "[]"):
            return []
        value = parse_toml(f"value = {text}", what=f"config key '{key}' on the command line (a TOML inline "
                           "array such as '[{name = \"bundled\", weight = 0.7}]')", error=ConfigError)["value"]
    if not isinstance(value, list) or not all(isinstance(table, dict) for table in value):
        raise ConfigError(f"config key '{key}' expects a list of tables ([[{key}]] in a recipe), got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    entries = []
    for n, table in enumerate(value):
        entry = cls()
        for name, item in table.items():
            if name not in fields:
                close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
                hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
                raise ConfigError(f"unknown key '{name}' in {key}[{n}]; {hint}")
            item = _coerce(f"{key}[{n}].{name}", hints[name], item, from_text=False)
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                _check_number(f"{key}[{n}].{name}", item, fields[name].metadata)
            setattr(entry, name, item)
        entries.append(entry)
    return entries


def _set(cfg: JobConfig, key: str, value: Any, from_text: bool, where: str) -> None:
    specs = field_specs()
    if key not in specs:
        raise _unknown_key(key, where)
    typ, f = specs[key]
    value = _coerce(key, typ, value, from_text)
    section, name = key.split(".", 1)
    setattr(getattr(cfg, section), name, value)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--a.b', 'v', '--c.d=w', '--e.enable_f'] -> [('a.b', 'v'), ('c.d', 'w'), ('e.enable_f', 'true')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:  # a bare switch turns a boolean on
            key, value = arg[2:], "true"
            i += 1
        pairs.append((key.replace("-", "_"), value))
    return pairs


def check_overrides(command: str, overrides: list[str] | None) -> list[tuple[str, str]]:
    """The parsed overrides; a known key that ``command`` does not read is a ConfigError naming both.

    Only the command line is checked: a recipe is shared by train and the tools. Unknown keys are
    left to the loader, which names the nearest valid one."""
    pairs = parse_overrides(overrides or [])
    keys = list(field_specs())
    for key, _ in pairs:
        problem = commands.refusal(command, key, keys) if key in field_specs() else None
        if problem:
            raise ConfigError(problem)
    return pairs


def load_config(
    config_path: str | Path | None = None, overrides: list[str] | None = None, *, command: str | None = None
) -> JobConfig:
    """The recipe with the overrides applied, validated. ``command``: the running subcommand
    (a key of ``titanctl.config.commands.READS``), whose unread overrides are refused before the
    recipe is read; None (library callers) accepts every key."""
    pairs = check_overrides(command, overrides) if command else parse_overrides(overrides or [])
    cfg = JobConfig()
    if config_path:
        path = Path(config_path)
        data = parse_toml(_read_text(path), what=str(path), error=ConfigError)
        for section, values in data.items():
            if not isinstance(values, dict):
                raise _unknown_key(section, f" in {path}")
            for name, value in values.items():
                _set(cfg, f"{section}.{name}", value, from_text=False, where=f" in {path}")
    for key, value in pairs:
        _set(cfg, key, value, from_text=True, where=" on the command line")
    validate(cfg, command)
    return cfg


def _read_text(path: Path) -> str:
    """The recipe's text; a missing, unreadable or non-UTF-8 file is a ConfigError naming it."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    raw = read_bytes(path, what="config file", max_bytes=MAX_RECIPE_BYTES, error=ConfigError)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); TOML files are UTF-8"
        ) from None


def _number(x: float) -> str:
    """2**64 reads as 2^64, other bounds as written."""
    if isinstance(x, int) and x >= 2**16 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def valid_range(meta: dict) -> str:
    """'>= 0', '> 0', 'in [0, 1]', 'in [0, 1)', ... from a field's bounds; '' without any."""
    low, high = meta.get("min"), meta.get("max")
    above, below = meta.get("above"), meta.get("below")
    if (low is not None or above is not None) and (high is not None or below is not None):
        left = f"[{_number(low)}" if low is not None else f"({_number(above)}"
        right = f"{_number(high)}]" if high is not None else f"{_number(below)})"
        return f"in {left}, {right}"
    for bound, sign in ((low, ">="), (above, ">"), (high, "<="), (below, "<")):
        if bound is not None:
            return f"{sign} {_number(bound)}"
    return ""


def _in_range(value: float, meta: dict) -> bool:
    low, high = meta.get("min"), meta.get("max")
    above, below = meta.get("above"), meta.get("below")
    return not (
        (low is not None and value < low)
        or (high is not None and value > high)
        or (above is not None and value <= above)
        or (below is not None and value >= below)
    )


def _check_number(key: str, value: float, meta: dict) -> None:
    """Finite floats within float32's range, ints that fit in 64 bits, and the field's own bounds."""
    bounds = valid_range(meta)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' = {value!r} must be a finite number" + (f" {bounds}" if bounds else ""))
    if not _in_range(value, meta):
        raise ConfigError(f"config key '{key}' = {value!r} must be {bounds}")
    own_limit = meta.get("max") is not None or meta.get("below") is not None
    if isinstance(value, float) and not own_limit and abs(value) > FLOAT32_MAX:
        # Float keys become float32 tensor values (a learning rate, a loss weight), where this overflows.
        raise ConfigError(f"config key '{key}' = {value!r} is past float32's largest value, {FLOAT32_MAX:.4g}, which "
                          f"training computes in; valid: {bounds + ' and ' if bounds else ''}at most {FLOAT32_MAX:.4g}")
    if isinstance(value, int) and not own_limit and not -(2**63) <= value < 2**63:
        raise ConfigError(f"config key '{key}' = {value!r} does not fit in 64 bits; valid: [-2^63, 2^63)")


def _check_utf8(key: str, value: str) -> None:
    """Command-line bytes that are not UTF-8 arrive as lone surrogates: no file, TensorBoard event or
    checkpoint name can carry them, so they are refused here rather than as a traceback later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raw = value.encode("utf-8", "surrogateescape")
        raise ConfigError(f"config key '{key}' = {raw!r} is not UTF-8 text; use a UTF-8 name") from None


def _check_in_dump_folder(key: str, value: str, default: str) -> None:
    """A folder documented as relative to job.dump_folder must name a folder inside it: an absolute
    path or one climbing out with '..' would write (and prune checkpoints) anywhere."""
    parts = PurePosixPath(posixpath.normpath(value.replace("\\", "/"))).parts if value else ()
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute():
        problem = "is absolute"
    elif not parts or parts == (".",):
        problem = "is the dump folder itself"
    elif parts[0] == "..":
        problem = "leads out of the dump folder"
    else:
        return
    hint = (
        "; to start from another run's checkpoint, set checkpoint.initial_load_path to its step folder "
        "(with checkpoint.initial_load_model_weights_only = false to take its optimizer and data position too)"
        if key == "checkpoint.folder" else ""
    )
    raise ConfigError(
        f"config key '{key}' = {value!r} {problem}: it must be a relative path to a folder inside "
        f"job.dump_folder, e.g. {default!r}{hint}"
    )


def validate(cfg: JobConfig, command: str | None = None) -> None:
    """Check choices, ranges, folders and relations between keys that need no runtime facts
    (``command``: the running subcommand, when it reads a key otherwise than training does)."""
    for key, (_, f) in field_specs().items():
        section, name = key.split(".", 1)
        value = getattr(getattr(cfg, section), name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            by_lower = {str(c).lower(): str(c) for c in choices}
            close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1)
            hint = f"; did you mean '{by_lower[close[0]]}'?" if close else ""
            raise ConfigError(
                f"config key '{key}' = {value!r} is not one of {', '.join(map(str, choices))}{hint}"
            )
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                _check_number(key, item, f.metadata)
            elif isinstance(item, str):
                _check_utf8(key, item)
        if f.metadata.get("in_dump_folder"):
            _check_in_dump_folder(key, value, f.default)
    flavors = MODEL_FLAVORS[cfg.model.name]
    if cfg.model.flavor not in flavors:
        close = difflib.get_close_matches(cfg.model.flavor, flavors, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config key 'model.flavor' = {cfg.model.flavor!r} is not a {cfg.model.name} flavor; choose one of "
            f"{', '.join(flavors)}{hint}"
        )
    if not cfg.job.dump_folder.strip():
        raise ConfigError("config key 'job.dump_folder' is empty; give the run's output folder (e.g. './outputs')")
    gbs = cfg.training.global_batch_size
    if gbs != -1 and gbs < cfg.training.local_batch_size:
        raise ConfigError(
            f"config key 'training.global_batch_size' = {gbs} must be -1 or at least "
            f"training.local_batch_size = {cfg.training.local_batch_size}"
        )
    shard = cfg.parallelism.data_parallel_shard_degree
    if shard == 0 or shard < -1:
        raise ConfigError(f"config key 'parallelism.data_parallel_shard_degree' = {shard} must be -1 or >= 1")
    _check_pipeline_keys(cfg.parallelism)
    _check_datasets(cfg.training)
    _check_optimizer_groups(cfg.optimizer)
    if cfg.lora.target_regex:
        check_user_regex("lora.target_regex", cfg.lora.target_regex)
    _check_chat_masking(cfg, command)
    _check_hf_save_keys(cfg.checkpoint)
    _check_fault_tolerance(cfg)


# Inner before outer: each timeout must expire before the one that waits around it, or a dead replica
# group is noticed by the outer wait (the quorum, or the hang watchdog that ends the process) first.
FT_TIMEOUTS = (
    "fault_tolerance.connect_timeout_seconds",
    "fault_tolerance.process_group_timeout_seconds",
    "fault_tolerance.timeout_seconds",
    "fault_tolerance.quorum_timeout_seconds",
    "comm.train_timeout_seconds",
)


def _check_fault_tolerance(cfg) -> None:
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"config key 'fault_tolerance.replica_id' = {ft.replica_id} must be below fault_tolerance.group_size = "
            f"{ft.group_size}"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"config key 'fault_tolerance.min_replica_size' = {ft.min_replica_size} exceeds "
            f"fault_tolerance.group_size = {ft.group_size}: no step could ever commit"
        )
    values = [getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in FT_TIMEOUTS]
    for (inner, a), (outer, b) in zip(zip(FT_TIMEOUTS, values), zip(FT_TIMEOUTS[1:], values[1:])):
        if a >= b:
            raise ConfigError(
                f"timeouts inverted: '{inner}' = {_number(a)} must be below '{outer}' = {_number(b)} "
                f"(order: {' < '.join(k.split('.')[1] for k in FT_TIMEOUTS)})"
            )
    if ft.fragments > 1 and ft.semi_sync_method != "diloco":
        raise ConfigError(
            f"config key 'fault_tolerance.fragments' = {ft.fragments} needs fault_tolerance.semi_sync_method = "
            f"diloco (now {ft.semi_sync_method})"
        )
    if ft.semi_sync_method == "diloco" and ft.sync_steps % ft.fragments:
        raise ConfigError(
            f"config key 'fault_tolerance.sync_steps' = {ft.sync_steps} must be a multiple of "
            f"fault_tolerance.fragments = {ft.fragments}: each fragment syncs once every sync_steps"
        )
    p = cfg.parallelism
    for key, value in (("data_parallel_replicate_degree", p.data_parallel_replicate_degree),
                       ("pipeline_parallel_degree", p.pipeline_parallel_degree)):
        if value != 1:
            raise ConfigError(
                f"config key 'parallelism.{key}' = {value} must be 1 with fault_tolerance.enable: the replica "
                "groups are the replicas (FSDP, TP, CP and EP work inside a group)"
            )


def _check_optimizer_groups(optimizer) -> None:
    """Each [[optimizer.groups]] table names its parameters with a valid regex and a known optimizer;
    whether it matches a parameter is known only once the model is built (titanctl.train.param_groups)."""
    for n, table in enumerate(optimizer.groups):
        where = f"optimizer.groups[{n}]"
        if not table.params:
            raise ConfigError(f"config key '{where}.params' is empty; give a canonical parameter name or a regex")
        check_user_regex(f"{where}.params", table.params)
        if table.optimizer not in ("", "Muon", "AdamW"):
            raise ConfigError(f"config key '{where}.optimizer' = {table.optimizer!r} is not one of Muon, AdamW")
        if table.optimizer and optimizer.name == "Adam":  # Adam's L2 decay has no per-group Muon/AdamW form
            raise ConfigError(f"config key '{where}.optimizer' = {table.optimizer!r} needs optimizer.name Muon or "
                              "AdamW, not Adam")


# Keys of a mixture entry that only hub streams read, with their defaults.
_HF_ONLY = {"config": "", "split": "train", "text_field": "text"}


def _check_datasets(training) -> None:
    """A mixture replaces training.dataset/dataset_path; each entry names exactly one source, once."""
    if not training.datasets:
        return
    if training.dataset != "bundled" or training.dataset_path:
        raise ConfigError(
            "config key 'training.datasets' (a mixture) replaces training.dataset and training.dataset_path: "
            f"unset those (now {training.dataset!r} and {training.dataset_path!r}) or the mixture"
        )
    labels: set[str] = set()
    for n, entry in enumerate(training.datasets):
        where = f"training.datasets[{n}]"
        for f in dataclasses.fields(entry):
            value = getattr(entry, f.name)
            if isinstance(value, str):
                _check_utf8(f"{where}.{f.name}", value)
            else:
                _check_number(f"{where}.{f.name}", value, f.metadata)
        if bool(entry.name) == bool(entry.path):
            got = f"both name {entry.name!r} and path {entry.path!r}" if entry.name else "neither"
            raise ConfigError(
                f"{where} needs exactly one of name (bundled, bundled_val, c4, hf:<id>) or path "
                f"(a local file or folder); got {got}"
            )
        extras = [k for k, default in _HF_ONLY.items() if getattr(entry, k) != default]
        if entry.name.startswith("chat:"):  # a chat folder has splits too
            extras = [k for k in extras if k != "split"]
        if extras and not entry.name.startswith("hf:"):
            verb = "applies" if len(extras) == 1 else "apply"
            raise ConfigError(f"{where}: {', '.join(extras)} {verb} only to hf: datasets, not to {entry.label!r}")
        if entry.label in labels:
            raise ConfigError(f"{where}: {entry.label!r} is already in the mixture; give it once, with one weight")
        labels.add(entry.label)


def _check_chat_masking(cfg, command: str | None = None) -> None:
    """Chat data packs several conversations into a window: each must see only itself. The [sft] keys
    act only on chat data (set without any they would be ignored), but infer-tp --chat renders its
    prompt with sft.chat_template_path."""
    validation = cfg.validation.dataset if cfg.validation.enabled else ""
    names = [cfg.training.dataset, validation, *(entry.name for entry in cfg.training.datasets)]
    chat = next((name for name in names if name.startswith("chat:")), None)
    defaults = SFT()
    for f in dataclasses.fields(SFT):
        value = getattr(cfg.sft, f.name)
        if value == getattr(defaults, f.name) or (command == "infer-tp" and f.name == "chat_template_path"):
            continue
        if chat is None:
            raise ConfigError(f"config key 'sft.{f.name}' = {value!r} acts on chat data only, and no dataset is "
                              "chat:...; unset it, or give chat data (training.dataset = 'chat:FILE')")
        if f.name == "validation_split" and not validation.startswith("chat:"):
            raise ConfigError(f"config key 'sft.validation_split' = {value!r} is the split validation.dataset = "
                              "'chat:...' reads, but validation reads no chat data; unset it")
    if chat is not None and cfg.model.attn_mask_type != "block_causal":
        raise ConfigError(
            f"chat data ({chat!r}) packs several conversations into each window, which needs "
            f"model.attn_mask_type = 'block_causal' (each conversation attends only to itself, its positions "
            f"start at 0), not {cfg.model.attn_mask_type!r}"
        )


def _check_hf_save_keys(ck) -> None:
    """Hugging Face saves are saves: asked for without checkpointing they would silently not happen."""
    if ck.enable_checkpoint:
        return
    if ck.last_save_in_hf:
        raise ConfigError("config key 'checkpoint.last_save_in_hf' = true needs checkpoint.enable_checkpoint = true")
    if ck.save_format != "dcp":
        raise ConfigError(
            f"config key 'checkpoint.save_format' = {ck.save_format!r} needs checkpoint.enable_checkpoint = true"
        )


def _check_pipeline_keys(p) -> None:
    """Pipeline keys act only with a pipeline (set without one they would be ignored), and a
    schedule file must exist before anything starts."""
    if p.pipeline_parallel_degree == 1:
        for name in ("pipeline_parallel_split_points", "pipeline_parallel_layers_per_stage",
                     "pipeline_parallel_schedule_csv"):
            value = getattr(p, name)
            if value:
                raise ConfigError(
                    f"config key 'parallelism.{name}' = {value!r} takes effect only with a pipeline: set "
                    "parallelism.pipeline_parallel_degree > 1, or leave the key unset"
                )
    if p.pipeline_parallel_schedule_csv:
        regular_file_size(Path(p.pipeline_parallel_schedule_csv), what="pipeline_parallel_schedule_csv",
                          error=ConfigError)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # a table of a list of tables, written inline
        items = (f"{f.name} = {_toml_value(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return "{" + ", ".join(items) + "}"
    return repr(value)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back unchanged."""
    lines = []
    for section in _sections():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if value is None:
                lines.append(f"# {f.name} is unset")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def reference_table() -> str:
    """A Markdown table of every key, its default and its help (for docs/config.md)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    defaults = JobConfig()
    for key, (_, f) in field_specs().items():
        section, name = key.split(".", 1)
        value = getattr(getattr(defaults, section), name)
        help_text = f.metadata["help"]
        if f.metadata.get("choices"):
            help_text += " One of: " + ", ".join(map(str, f.metadata["choices"])) + "."
        if valid_range(f.metadata):
            help_text += f" Valid: {valid_range(f.metadata)}."
        if f.metadata.get("in_dump_folder"):
            help_text += " Must name a folder inside it (no absolute path, no '..' out of it)."
        shown = "unset" if value is None else _toml_value(value)
        rows.append(f"| `{key}` | `{shown}` | {help_text} |")
    return "\n".join(rows)
