"""Convert a checkpoint between the Meta, DCP, Hugging Face, torchtune and torchtitan formats.

Every conversion is: open the source (its format told or detected), settle the model
(the source's own config, or ``--flavor``/``--config`` with the vocabulary taken from the
embedding), check every tensor against it before writing anything, then stream the
tensors one by one into the writer of the target format, inside a temporary folder that
is renamed to the destination only when complete. See docs/checkpoints.md.

torch and the format modules are imported inside the functions, after the cheap checks
of SRC and DST, so a mistyped path fails at once.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titanctl.checkpoint.formats import FORMATS, WRITERS, DictSource, Source, open_source
from titanctl.checkpoint.formats.base import UntiedView
from titanctl.checkpoint.hf.carried_config import HF_CONFIG_KEY
from titanctl.checkpoint.hf.hub_layout import TEXT_ONLY_FLAG, naming_only
from titanctl.checkpoint.hf.names import HF_FILES_KEY
from titanctl.checkpoint.hf.serving_kernels import serving_warning
from titanctl.checkpoint.hf.tokenizer_export import resolve_tokenizer, write_companion_files
from titanctl.checkpoint.hf.uncarried import check_carried
from titanctl.checkpoint.locate import Located, locate
from titanctl.checkpoint.trust.reader import one_line
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import flavor_args, model_args_from_config, spec_of
from titanctl.safe_io import hold_partial, partial_in_use, partial_lock, release_partial

# A LoRA step's adapters alone: written by titanctl.checkpoint.lora.export, read onto a base by lora.peft_import.
ADAPTER_FORMATS = ("peft",)
TOKENIZER_FORMATS = ("hf", "torchtune", "dcp")
# Formats whose loaders expect the output layer as a weight of its own, also in a tied model.
UNTIED_FORMATS = ("meta", "torchtune", "torchtitan")  # outputs that carry (or record) the tokenizer
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch dtype name
FP8_DEFAULT_DTYPE = torch.bfloat16  # what FP8 weights of a source become when --dtype says nothing
WARNING = "warning: "  # a note that begins so is a warning (the CLI shows it so)
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, 1000 -> 1000 (as transformers reads sizes)."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(text)
    if not m:
        raise CheckpointError(f"cannot read size {text!r}: give e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    key = _DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise CheckpointError(f"unknown --dtype {name!r}; valid: {', '.join(DTYPES)}")

    return getattr(torch, DTYPES[key])


def _check_format(fmt: str | None, flag: str) -> None:
    valid = (*FORMATS, *ADAPTER_FORMATS)
    if fmt is not None and fmt not in valid:
        raise CheckpointError(f"unknown {flag} format {fmt!r}; valid: {', '.join(valid)}")


def resolve_args(
    source: Source,
    flavor: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
) -> tuple[ModelArgs, str]:
    """The model to check the source against, and where it came from (for messages). ``overrides``:
    ``--section.key VALUE`` changes to the recipe ``config`` (e.g. ``--model.n_layers 2``)."""
    if flavor and config:
        raise CheckpointError("give --flavor or --config, not both")
    if overrides and not config:
        raise CheckpointError(
            f"{' '.join(overrides)}: --section.key options change the recipe of --config; give --config too"
        )
    if flavor:
        try:
            base, origin = flavor_args(flavor), f"--flavor {flavor}"
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    elif config:
        cfg = load_config(config, overrides, command="convert")
        base = model_args_from_config(cfg.model, 1, cfg.training.seq_len)
        origin = f"--config {config}" + (f" {' '.join(overrides)}" if overrides else "")
    else:
        args, origin = source.own_args()
        if args is None:
            raise CheckpointError(
                f"{source.folder} has no model config ({origin}): give --flavor or --config to say which model it is"
            )
        return args, origin
    return base.replace(vocab_size=source.vocab_size(base.dim)), origin


def _locate_source(folder: str | os.PathLike, fmt: str | None) -> Located:
    """SRC resolved (a folder of step-N folders -> its newest complete one) and its format, or a
    one-line CheckpointError (``titanctl.checkpoint.locate``)."""
    _check_format(fmt, "--from")
    return locate(folder, "checkpoint", fmt)


def open_checkpoint(
    folder: str | os.PathLike,
    fmt: str | None = None,
    *,
    flavor: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    dequantize_to: torch.dtype = torch.float32,
) -> Source:
    """A checked, ready-to-read source: ``with open_checkpoint(path) as src: src.load(name)``.

    ``folder``: a checkpoint folder, or a folder of step-N folders (its newest complete one is read).
    ``dequantize_to``: the dtype of block-quantized FP8 weights once multiplied by their scales
    (``titanctl.checkpoint.quantized.fp8_blocks``); other weights keep theirs.
    """
    located = _locate_source(folder, fmt)
    source = open_source(located.folder, located.format)
    source.dequantize_to = dequantize_to
    try:
        args, origin = resolve_args(source, flavor, config, overrides)
        source.bind(args, origin)
        source.origin = origin
    except BaseException:
        source.close()
        raise
    return source


def load_checkpoint(
    folder: str | os.PathLike, fmt: str | None = None, **kwargs
) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """The whole model state dict (canonical names) and its ModelArgs; for small models and tests."""
    with open_checkpoint(folder, fmt, **kwargs) as source:
        return dict(source.iter_tensors()), source.args


@dataclass
class ConversionReport:
    src: Path
    dst: Path
    src_format: str
    dst_format: str
    args: ModelArgs
    origin: str
    tensors: int
    nbytes: int
    seconds: float
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was ignored, which tokenizer, ...


class ProgressSink:
    """Where a conversion reports progress (the CLI draws a rich bar; the default says nothing)."""

    def start(self, total_bytes: int, description: str) -> None:
        pass

    def advance(self, name: str, nbytes: int) -> None:
        pass


def _check_destination(dst: Path, src: Path | None) -> None:
    try:
        if dst.is_symlink():
            # The finished folder is renamed onto DST: that would replace the link, not fill its target.
            raise CheckpointError(
                f"destination {dst} is a symbolic link (to {os.readlink(dst)}): give the folder it points to, "
                "or a new path"
            )
        if src is not None and dst.resolve() == src.resolve():
            raise CheckpointError(f"destination {dst} is the source folder")
        if src is not None and dst.resolve().is_relative_to(src.resolve()):
            raise CheckpointError(f"destination {dst} is inside the source folder {src}: give a folder outside it")
        if dst.exists():
            if not dst.is_dir():
                raise CheckpointError(f"destination {dst} exists and is not a folder")
            if any(dst.iterdir()):
                raise CheckpointError(f"destination {dst} is not empty: refusing to overwrite it (give a new folder)")
    except OSError as e:
        raise CheckpointError(f"cannot use destination {dst}: {e.strerror or e}") from None


def _check_options(
    fmt: str, shards: int | None, max_shard_size: int | str | None, tokenizer_path: str | os.PathLike | None = None,
    text_only: bool = False,
) -> None:
    if shards is not None and fmt != "meta":
        raise CheckpointError("--shards applies to --to meta only")
    if max_shard_size is not None and fmt != "hf":
        raise CheckpointError("--max-shard-size applies to --to hf only")
    if text_only and fmt != "hf":
        raise CheckpointError(f"{TEXT_ONLY_FLAG} applies to --to hf only")
    if tokenizer_path and fmt not in TOKENIZER_FORMATS:
        raise CheckpointError(f"--tokenizer-path applies to --to {', '.join(TOKENIZER_FORMATS)} only, not {fmt}")


def _prepare_destination(dst: Path, src: Path | None) -> Path:
    """Check DST, then make the temporary folder beside it (``.DST.partial-PID``) that becomes DST
    when complete. Such folders left by a conversion that was killed are removed first; one whose
    process still runs means another conversion is writing DST."""
    _check_destination(dst, src)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        for leftover in dst.parent.glob(f".{glob.escape(dst.name)}.partial-*"):
            pid = leftover.name.rsplit("-", 1)[1]
            if not pid.isdigit() or not leftover.is_dir() or leftover.is_symlink():
                continue
            if partial_in_use(leftover):
                raise CheckpointError(f"another conversion (process {pid}) is writing {dst}: wait for it, or stop it")
            shutil.rmtree(leftover)
            partial_lock(leftover).unlink(missing_ok=True)
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        tmp.mkdir()
        hold_partial(tmp, what="conversion lock", error=CheckpointError)
    except OSError as e:
        raise CheckpointError(f"cannot write next to destination {dst}: {e.strerror or e}") from None
    return tmp


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# How torch's zip writer ("unexpected pos 704 vs 598") and safetensors ("os error 27") report them.
_FULL_TEXT = re.compile(r"unexpected pos \d+ vs \d+|os error (" + "|".join(map(str, _FULL)) + r")\b")


def _out_of_space(e: BaseException) -> bool:
    """A write cut short by a full disk, a quota or a file-size limit."""
    if isinstance(e, OSError):
        return e.errno in _FULL
    return isinstance(e, Exception) and bool(_FULL_TEXT.search(str(e)))


def write_checkpoint(
    source: Source,
    dst: str | os.PathLike,
    fmt: str,
    *,
    dtype: torch.dtype | None = None,
    shards: int | None = None,
    max_shard_size: int | str | None = None,
    progress: ProgressSink | None = None,
    extra_metadata: dict | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    notes: list[str] | None = None,
    drop_expert_bias: bool = False,
    text_only: bool = False,
) -> list[str]:
    """Write a bound source as `fmt` into `dst` (new or empty), atomically. Returns the files written.

    hf and torchtune outputs also get the tokenizer files (see ``hf.tokenizer_export``); a dcp
    output records the tokenizer path. A Hugging Face source's config.json travels with the weights:
    a dcp output stores it, an hf output writes it back (``hf.carried_config``). What is worth telling
    the user is appended to `notes`. Trained state the format has no slot for is refused unless
    ``drop_expert_bias`` (``titanctl.checkpoint.hf.uncarried``). The source's carried tensors (a
    vision-language folder's vision encoder and prediction head: ``hf.hub_layout``) go into dcp and hf
    outputs as they are, unless ``text_only`` (hf: the text model's ``*ForCausalLM`` folder).
    """
    _check_format(fmt, "--to")
    _check_options(fmt, shards, max_shard_size, tokenizer_path, text_only)
    spec = spec_of(source.args)
    if fmt not in ("dcp", "hf", *spec.formats):
        raise CheckpointError(
            f"{spec.name} has no {fmt} checkpoint format; write one of {', '.join(('dcp', 'hf', *spec.formats))}"
        )
    if source.args.tie_embeddings and fmt in UNTIED_FORMATS:
        source = UntiedView(source)
    notes = [] if notes is None else notes
    if (dropped := check_carried(source, fmt, drop_expert_bias)) is not None:
        notes.append(dropped)
    if source.carried and fmt not in ("dcp", "hf"):
        notes.append(f"{len(source.carried)} carried tensors of a vision-language folder ({source.carried[0].name}, "
                     f"...) left out: the {fmt} format holds the text model only (dcp and hf carry them)")
    if fmt == "hf" and (unservable := serving_warning(source.args)):
        notes.append(f"{WARNING}{unservable}")
    tokenizer, recorded_path = None, None
    if fmt in TOKENIZER_FORMATS:  # before anything is written: a wrong tokenizer is an error
        tokenizer, recorded_path, said = resolve_tokenizer(source, source.args, tokenizer_path, fmt == "dcp")
        if said:
            notes.append(said)
    source_config = source.extra_metadata().get(HF_CONFIG_KEY) if fmt in ("dcp", "hf") else None
    source_files = source.extra_metadata().get(HF_FILES_KEY) if fmt in ("dcp", "hf") else None
    dst = Path(dst)
    src_folder = source.folder if source.folder.exists() else None
    sink = progress or ProgressSink()
    sink.start(source.total_bytes(dtype), f"{source.format} → {fmt}")
    options: dict = {}
    if fmt == "meta":
        options["shards"] = 1 if shards is None else shards
    elif fmt == "hf":
        if max_shard_size is not None:
            options["max_shard_size"] = parse_size(max_shard_size)
        if tokenizer is not None:  # config.json names the exported tokenizer's ids
            options["token_ids"] = (tokenizer.bos_id, tokenizer.eos_id)
        options["source_config"] = source_config
        options["notes"] = notes
        # A size asked for: new shards, in the source's names.
        options["layout"] = source_files if max_shard_size is None else naming_only(source_files)
        options["text_only"] = text_only
    elif fmt == "dcp":
        carried = source.extra_metadata()
        options["step"] = int(carried.get("step", 0))
        options["extra"] = {"converted_from": source.format, **(extra_metadata or {})}
        if source_config is not None:
            options["extra"][HF_CONFIG_KEY] = source_config
        if source_files is not None:
            options["extra"][HF_FILES_KEY] = source_files
        if recorded_path is not None:
            options["extra"]["tokenizer_path"] = recorded_path
    with _written_into(dst, src_folder) as tmp:
        WRITERS[fmt](tmp, source.args, source, dtype=dtype, progress=sink.advance, **options)
        notes.extend(write_companion_files(tmp, fmt, source.args, tokenizer))
    return sorted(p.name for p in dst.iterdir())


@contextlib.contextmanager
def _written_into(dst: Path, src: Path | None) -> Iterator[Path]:
    """The temporary folder beside DST (``_prepare_destination``) to write into: renamed to DST when the
    block completes, removed when it fails (a full disk said in one line), so DST is whole or untouched."""
    tmp = _prepare_destination(dst, src)
    try:
        yield tmp
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.rename(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(e):
            raise CheckpointError(
                f"writing {dst} failed: the disk or quota is full ({one_line(e)}); {dst} was left as it was"
            ) from None
        raise
    finally:
        release_partial(tmp)


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    flavor: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    shards: int | None = None,
    max_shard_size: int | str | None = None,
    progress: ProgressSink | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    merge_lora: bool = False,
    lora_base: str | os.PathLike | None = None,
    drop_expert_bias: bool = False,
    text_only: bool = False,
) -> ConversionReport:
    """Convert the checkpoint folder `src` into `dst` (which must not exist or be empty).

    ``dst_format`` defaults to ``dcp`` (bringing a model in), or ``hf`` when the source is
    a DCP checkpoint (taking a run out). Block-quantized FP8 weights (DeepSeek-V3's release) are
    dequantized to ``dtype``, by default to bfloat16 (DeepSeek's own ``fp8_cast_bf16``: what the
    model trains in, and twice the FP8 size rather than four times); the others keep theirs unless
    ``dtype`` is given.

    A LoRA run's step (adapters only) converts with ``merge_lora`` (the base with the adapters folded in,
    in any format; the base from ``lora_base`` or where the step records it) or to ``peft`` (the
    adapters alone): ``titanctl.checkpoint.lora.export``. A peft adapter (``src_format`` peft, or a
    folder holding adapter_config.json) becomes such a step on the base ``lora_base``
    (``titanctl.checkpoint.lora.peft_import``).

    ``text_only``: of a vision-language folder (``hf.hub_layout``), an hf output of the text model alone.
    """
    _check_format(src_format, "--from")
    _check_format(dst_format, "--to")
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if src_format in ADAPTER_FORMATS or (src_format is None and _holds_peft_adapter(Path(src))):
        given = {"--merge-lora": merge_lora, f"--to {dst_format}": dst_format not in (None, "dcp"), "--flavor": flavor,
                 "--config": config, " ".join(overrides or ()): overrides, "--shards": shards,
                 "--max-shard-size": max_shard_size, "--tokenizer-path": tokenizer_path,
                 "--drop-expert-bias": drop_expert_bias, TEXT_ONLY_FLAG: text_only}
        if (misused := next((flag for flag, value in given.items() if value), None)) is not None:
            raise CheckpointError(
                f"{misused} does not apply to --from peft, which writes a titanctl LoRA checkpoint (dcp) of the "
                "adapter on its base: export or merge that one (`titanctl convert OUT MERGED --merge-lora`)"
            )
        return _import_peft(Path(src), Path(dst), lora_base, torch_dtype, progress)
    located = _locate_source(src, src_format)
    _check_destination(Path(dst), Path(src))  # before reading any tensor
    if dst_format is not None and dst_format not in ADAPTER_FORMATS:
        _check_options(dst_format, shards, max_shard_size, tokenizer_path, text_only)
    dst = Path(dst)
    lora = _lora_record(located)
    if lora is not None or merge_lora or dst_format in ADAPTER_FORMATS or lora_base is not None:
        return _convert_lora(located, Path(src), dst, lora, dst_format=dst_format, merge=merge_lora, base=lora_base,
                             dtype=torch_dtype, shards=shards, max_shard_size=max_shard_size, progress=progress,
                             tokenizer_path=tokenizer_path, drop_expert_bias=drop_expert_bias, text_only=text_only)

    start = time.perf_counter()
    dequantize_to = torch_dtype or FP8_DEFAULT_DTYPE
    with open_checkpoint(
        located.folder, located.format, flavor=flavor, config=config, overrides=overrides, dequantize_to=dequantize_to
    ) as source:
        fmt = dst_format or ("hf" if source.format == "dcp" else "dcp")
        notes = list(source.notes)
        if located.folder != Path(src):
            notes.insert(0, f"read {located.folder.name}, the newest complete checkpoint in {src}")
        files = write_checkpoint(
            source, dst, fmt, dtype=torch_dtype, shards=shards, max_shard_size=max_shard_size, progress=progress,
            tokenizer_path=tokenizer_path, notes=notes, drop_expert_bias=drop_expert_bias, text_only=text_only,
        )
        return ConversionReport(
            src=Path(src),
            dst=dst,
            src_format=source.format,
            dst_format=fmt,
            args=source.args,
            origin=source.origin,
            tensors=len(source.infos),
            nbytes=source.total_bytes(torch_dtype),
            seconds=time.perf_counter() - start,
            files=files,
            notes=notes,
        )


def _holds_peft_adapter(folder: Path) -> bool:
    from titanctl.checkpoint.lora.export import PEFT_CONFIG

    try:
        return (folder / PEFT_CONFIG).is_file()
    except OSError:  # an unreadable folder: locate says so in one line
        return False


def _import_peft(src: Path, dst: Path, base: str | os.PathLike | None, dtype: torch.dtype | None,
                 progress: ProgressSink | None) -> ConversionReport:
    """A peft adapter folder onto ``base``: a titanctl LoRA step in ``dst``, written under a temporary name."""
    from titanctl.checkpoint.lora.peft_import import import_peft

    if base is None:
        raise CheckpointError(
            "--from peft reads an adapter onto the model it was made for: give --lora-base BASE (a titanctl step, or "
            "a Hugging Face, torchtitan, Meta or torchtune folder)"
        )
    if not src.is_dir():
        raise CheckpointError(f"peft adapter folder {src} {'is a file' if src.exists() else 'does not exist'}")
    start = time.perf_counter()
    base_located = locate(base, "--lora-base")
    _check_destination(dst, base_located.folder)  # the base's own files are fingerprinted
    with _written_into(dst, src) as tmp, open_checkpoint(base_located.folder, base_located.format) as source:
        count, nbytes, notes = import_peft(src, tmp, source, base_located.format, dtype=dtype,
                                           progress=progress or ProgressSink())
    return ConversionReport(src, dst, "peft", "dcp", source.args, f"the base {base_located.folder}", count, nbytes,
                            time.perf_counter() - start, sorted(p.name for p in dst.iterdir()), notes)


def _lora_record(located: Located) -> dict | None:
    """The ``lora`` entry of a titanctl step folder's titanctl.json (None: no adapters, or another format)."""
    from titanctl.checkpoint.lora.base import read_record
    from titanctl.checkpoint.trust.metadata import METADATA_FILE, read_metadata

    if located.format != "dcp" or not (located.folder / METADATA_FILE).is_file():
        return None
    return read_record(read_metadata(located.folder), located.folder)


def _convert_lora(
    located: Located, src: Path, dst: Path, lora: dict | None, *, dst_format: str | None, merge: bool,
    base: str | os.PathLike | None, dtype: torch.dtype | None, shards: int | None,
    max_shard_size: int | str | None, progress: ProgressSink | None, tokenizer_path: str | os.PathLike | None,
    drop_expert_bias: bool = False, text_only: bool = False,
) -> ConversionReport:
    """A LoRA step: ``--to peft`` (its adapters), or ``--merge-lora`` (its base with them folded in)."""
    from titanctl.checkpoint.hf.uncarried import check_adapter_export
    from titanctl.checkpoint.lora.base import base_folder, base_record, check_same_base
    from titanctl.checkpoint.lora.export import EXPERT_ADAPTERS_NOTE, MergedSource, read_lora_step, write_peft
    from titanctl.checkpoint.trust.metadata import model_args_from_metadata

    if lora is None:
        what = "--merge-lora" if merge else "--lora-base" if dst_format not in ADAPTER_FORMATS else f"--to {dst_format}"
        raise CheckpointError(f"{what} reads a LoRA run's step folder; {located.folder} holds no LoRA adapters")
    if dst_format in ADAPTER_FORMATS and merge:
        raise CheckpointError("--to peft writes the adapters alone: --merge-lora does not apply")
    if not merge and dst_format not in ADAPTER_FORMATS:
        raise CheckpointError(
            f"{located.folder} holds LoRA adapters only (trained on {lora['base']['path']}): add --merge-lora "
            "(the base with the adapters folded in) or use --to peft (the adapters for peft)"
        )
    start = time.perf_counter()
    step = read_lora_step(located.folder)
    meta, record, adapters = step.meta, step.record, step.adapters
    args = model_args_from_metadata(meta, str(located.folder))
    notes = [] if located.folder == src else [f"read {located.folder.name}, the newest complete checkpoint in {src}"]
    # The adapters mean something only on the base they were trained on: peft's too (it names the base).
    folder = base_folder(record, base, located.folder)
    base_located = _locate_source(folder, None)
    check_same_base(record["base"], base_record(base_located.folder, base_located.format), located.folder)
    if dst_format in ADAPTER_FORMATS:
        # peft adapts the base's Hugging Face model: the buffers it holds are the base's (zero where it has no slot).
        dropped = check_adapter_export(step.buffers, args, drop_expert_bias,
                                       lambda names: _base_tensors(record, located.folder, args, names))
        notes += [dropped] if dropped else []
        with _written_into(dst, src) as tmp:
            if record["base"]["format"] != "hf":
                notes.append(f"peft loads these adapters onto the Hugging Face model of their base: `titanctl "
                             f"convert {record['base']['path']} BASE_HF --to hf` makes it")
            write_peft(tmp, adapters, args, record, str(folder), dtype)
            if any(kind == "experts" for kind in record["targets"].values()):
                notes.append(EXPERT_ADAPTERS_NOTE)
        nbytes = sum(t.numel() * (dtype or t.dtype).itemsize for t in adapters.values())
        return ConversionReport(src, dst, "dcp", dst_format, args, "titanctl.json", len(adapters), nbytes,
                                time.perf_counter() - start, sorted(p.name for p in dst.iterdir()), notes)
    source = open_source(base_located.folder, base_located.format)
    source.dequantize_to = dtype or FP8_DEFAULT_DTYPE
    with source:
        source.bind(args, f"{located.folder}/titanctl.json")
        merged = MergedSource(source, adapters, record, located.folder, meta, step.buffers)
        merged.origin = "titanctl.json"
        fmt = dst_format or "hf"
        notes += [f"merged {len(record['targets'])} LoRA adapters into the base {base_located.folder}", *source.notes]
        files = write_checkpoint(merged, dst, fmt, dtype=dtype, shards=shards, max_shard_size=max_shard_size,
                                 progress=progress, tokenizer_path=tokenizer_path, notes=notes,
                                 drop_expert_bias=drop_expert_bias, text_only=text_only)
        return ConversionReport(src, dst, "dcp", fmt, args, "titanctl.json", len(merged.infos),
                                merged.total_bytes(dtype), time.perf_counter() - start, files, notes)


def _base_tensors(record: dict, folder: Path, args: ModelArgs, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the base a LoRA step records (read where it records it)."""
    from titanctl.checkpoint.lora.base import base_folder

    base = _locate_source(base_folder(record, None, folder), None)
    with open_source(base.folder, base.format) as source:
        source.bind(args, f"{folder}/titanctl.json")
        return {name: source.load(name) for name in names}


def save_state_dict(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    dst: str | os.PathLike,
    fmt: str = "dcp",
    **kwargs,
) -> list[str]:
    """Write an in-memory canonical state dict (``model.state_dict()``) in any format."""
    source = DictSource(state_dict, args)
    source.bind(args, "the given ModelArgs")
    source.origin = "the given ModelArgs"
    return write_checkpoint(source, dst, fmt, **kwargs)


__all__ = [
    "DTYPES",
    "ConversionReport",
    "ProgressSink",
    "convert_checkpoint",
    "load_checkpoint",
    "open_checkpoint",
    "parse_size",
    "resolve_args",
    "save_state_dict",
    "write_checkpoint",
]
