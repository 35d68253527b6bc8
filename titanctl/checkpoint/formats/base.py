"""What every checkpoint format shares: a streaming source of weights and its checks.

A ``Source`` reads one checkpoint folder and hands out its weights one tensor at a time,
already renamed and re-laid-out to titanctl's canonical form (titanctl's names, Meta's
interleaved RoPE rows), so a writer of any format only ever sees canonical tensors.
Each returned tensor is the caller's own copy: the source keeps nothing, and pages it
memory-mapped to produce it are handed back to the kernel (``PageReleaser``), so peak
memory stays near one tensor (plus whatever one output file needs) on any model size.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import math
import mmap
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanctl.checkpoint.trust.model_args import check_finite_numbers
from titanctl.checkpoint.trust.paths import check_inside
from titanctl.checkpoint.trust.shape_inference import kv_heads_hint
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import integer_state, tied_weights, weight_shapes
from titanctl.safe_io import load_json, read_head

FORMATS = ("meta", "dcp", "hf", "torchtune", "torchtitan")
# Derived RoPE tables that some tools save beside the weights: never weights, never written.
DERIVED_BUFFERS = ("rope.freqs", "freqs_cis", "rope_cache")

Progress = Callable[[str, int], None]  # (tensor name, bytes done) after each tensor


def no_progress(name: str, nbytes: int) -> None:
    pass


@dataclass(frozen=True)
class TensorInfo:
    """One weight of a source: canonical name, shape and dtype, and where it comes from."""

    name: str  # canonical (Meta) name, e.g. layers.0.attention.wq.weight
    shape: tuple[int, ...]  # in titanctl's layout
    dtype: torch.dtype
    shown: str  # the name as the source spells it (for messages)
    where: str  # the file that holds it (for messages)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return math.prod(self.shape) * written_dtype(self.dtype, dtype).itemsize


class Source(abc.ABC):
    """A checkpoint folder being read.

    Lifecycle: construct (finds and opens the files, cheap), ``own_args()`` (the model
    config the checkpoint carries, if any), ``bind(args, origin)`` (checks every tensor
    against the model and fixes ``infos``), then ``load(name)`` per tensor, ``close()``.
    """

    format: str = ""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.args: ModelArgs | None = None
        self.origin = ""  # where args came from, e.g. "params.json" or "--flavor 8B"
        self.infos: list[TensorInfo] = []  # in the order that reads the source best
        self.notes: list[str] = []  # worth telling the user, e.g. what was read but ignored
        # What block-quantized FP8 weights (a Hugging Face source's) are dequantized to; set before
        # ``bind``. float32 keeps ``fp8 * scale`` exactly as computed; ``convert`` asks for --dtype or bf16.
        self.dequantize_to: torch.dtype = torch.float32
        # Tensors of the folder that are no part of the model, carried as stored (``hf.hub_layout``: a
        # vision-language folder's vision encoder and prediction head): name, shape and dtype as stored.
        self.carried: list[TensorInfo] = []

    # -- configuration
    @abc.abstractmethod
    def own_args(self) -> tuple[ModelArgs | None, str]:
        """(ModelArgs from the checkpoint's own config or None, the config's file name)."""

    @abc.abstractmethod
    def vocab_size(self, dim: int) -> int:
        """The vocabulary size the embedding weight has (for --flavor/--config overrides)."""

    def embedding_rows(self, dim: int) -> int | None:
        """vocab_size(dim), or None when the checkpoint has no usable embedding (bind will say so)."""
        try:
            return self.vocab_size(dim)
        except CheckpointError:
            return None

    @abc.abstractmethod
    def bind(self, args: ModelArgs, origin: str) -> None:
        """Check the checkpoint against `args` (from `origin`) and fill ``infos``."""

    # -- data
    @abc.abstractmethod
    def load(self, name: str) -> torch.Tensor:
        """The canonical tensor `name`, as a fresh tensor the caller owns."""

    def load_slice(self, name: str, index: int, count: int) -> torch.Tensor | None:
        """Model-parallel slice `index` of `count` if the source has it stored as such, else None."""
        return None

    def load_carried(self, name: str) -> torch.Tensor:
        """The carried tensor `name` (one of ``carried``), as stored, as a fresh tensor the caller owns."""
        raise KeyError(name)

    def extra_metadata(self) -> dict[str, Any]:
        """Facts worth carrying into the output's own metadata (e.g. the training step)."""
        return {}

    def close(self) -> None:  # noqa: B027 - most sources hold nothing to release
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers
    def info(self, name: str) -> TensorInfo:
        if not hasattr(self, "_by_name") or len(self._by_name) != len(self.infos):
            self._by_name = {i.name: i for i in self.infos}
        return self._by_name[name]

    def total_bytes(self, dtype: torch.dtype | None = None) -> int:
        return sum(i.nbytes(dtype) for i in self.infos)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for info in self.infos:
            yield info.name, self.load(info.name)


def check_complete(infos: list[TensorInfo], args: ModelArgs, origin: str, folder: Path) -> None:
    """Every weight of the model exactly once, with its shape; one-line errors otherwise.

    Names must already be canonical: unknown source names are rejected by each format's
    name mapping (which knows how the source spells them). The tied alias of a weight is dropped
    from ``infos`` (a titanctl DCP checkpoint holds both keys; Hugging Face only the embedding).
    """
    aliases = tied_weights(args)  # a tied output layer is the embedding: stored once, if at all
    infos[:] = [info for info in infos if info.name not in aliases]
    expected = {name: shape for name, shape in weight_shapes(args).items() if name not in aliases}
    integers = integer_state(args)
    seen: dict[str, TensorInfo] = {}
    for info in infos:
        if info.name not in expected:
            raise CheckpointError(
                f"{info.where}: unknown tensor {info.shown!r} (not a weight of this model, "
                f"{args.n_layers} layers per {origin})"
            )
        if info.name in seen:
            raise CheckpointError(
                f"tensor {info.shown!r} appears twice ({seen[info.name].where} and {info.where})"
            )
        seen[info.name] = info
        want = expected[info.name]
        if tuple(info.shape) != want:
            raise CheckpointError(
                f"tensor {info.shown!r} in {info.where} has shape {tuple(info.shape)}, expected {want} "
                f"for the model from {origin}{kv_heads_hint(info.name, info.shape, want, args)}"
            )
        if info.name in integers:
            if info.dtype.is_floating_point or info.dtype.is_complex or info.dtype == torch.bool:
                raise CheckpointError(f"tensor {info.shown!r} in {info.where} has dtype {info.dtype}, not an integer")
        elif not info.dtype.is_floating_point:
            raise CheckpointError(f"tensor {info.shown!r} in {info.where} has dtype {info.dtype}, not a float")
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"checkpoint {folder} lacks tensor(s) {', '.join(missing[:3])}{more} that the model from {origin} has"
        )


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's config or index: a regular file, at most 64 MiB, nested at most 64 levels, every
    number finite."""
    data = load_json(path, what="checkpoint file", error=CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    check_finite_numbers(data, str(path))
    return data


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- memory-mapped files


class PageReleaser:
    """Hand pages of memory-mapped checkpoint files back to the kernel after use.

    ``torch.load(mmap=True)`` and ``safetensors`` map whole files; every page read stays
    resident (and counted in RSS) until the mapping goes, which for a model-parallel merge
    is the end of the run. Once a tensor has been copied out, ``MADV_DONTNEED`` drops its
    pages: for a file mapping that is never written this is always safe (a later read
    faults the page in again from the file). Only ranges inside mappings of the files
    given to ``track`` are touched, so anonymous memory can never be zeroed by mistake.
    Linux only; elsewhere it does nothing.
    """

    _MADV_DONTNEED = 4

    def __init__(self) -> None:
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self._libc = None
        if sys.platform.startswith("linux"):
            try:
                self._libc = ctypes.CDLL(None, use_errno=True)
                self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                self._libc = None

    def track(self, path: Path) -> None:
        """Record where `path` is mapped now (call after opening it)."""
        if self._libc is None:
            return
        real = os.path.realpath(path)
        ranges = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].rstrip("\n") == real:
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        ranges.append((lo, hi))
        except OSError:
            return
        self._ranges[real] = ranges

    def forget(self, path: Path) -> None:
        self._ranges.pop(os.path.realpath(path), None)

    def copy_out(self, view: torch.Tensor, chunk_bytes: int = 64 * 2**20) -> torch.Tensor:
        """A contiguous copy of a memory-mapped tensor, handing its pages back chunk by chunk, so the
        copy and the mapped pages are never both resident in full (1x the tensor, not 2x)."""
        out = torch.empty(view.shape, dtype=view.dtype)
        if not view.is_contiguous() or view.numel() == 0:
            out.copy_(view)
            self.release(view)
            return out
        src, dst = view.reshape(-1), out.view(-1)
        step = max(1, chunk_bytes // view.element_size())
        for start in range(0, src.numel(), step):
            dst[start : start + step].copy_(src[start : start + step])
            self.release(src[start : start + step])
        return out

    def copy_into(self, out: torch.Tensor, view: torch.Tensor, chunk_bytes: int = 64 * 2**20) -> None:
        """``out.copy_(view)`` (out may be a strided slice), a block of rows at a time, handing each
        block's pages back as it goes."""
        if view.ndim == 0 or not view.is_contiguous():
            out.copy_(view)
            self.release(view)
            return
        row_bytes = max(1, view[0].numel() * view.element_size())
        rows = max(1, chunk_bytes // row_bytes)
        for start in range(0, view.shape[0], rows):
            out[start : start + rows].copy_(view[start : start + rows])
            self.release(view[start : start + rows])

    def release(self, tensor: torch.Tensor) -> None:
        if self._libc is None or not self._ranges or tensor.numel() == 0:
            return
        page = mmap.PAGESIZE
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        lo = (start + page - 1) // page * page  # whole pages inside the tensor only
        hi = end // page * page
        if hi <= lo:
            return
        for ranges in self._ranges.values():
            if any(a <= lo and hi <= b for a, b in ranges):
                self._libc.madvise(lo, hi - lo, self._MADV_DONTNEED)
                return


# ----------------------------------------------------------------------------- torch.save files


# How a torch.save file begins: a zip archive, or (before torch 1.6) a pickle of this magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _check_torch_save_file(path: Path) -> None:
    """A bare pickle is refused before torch sees it (torch warns about its protocol on stderr)."""
    head = read_head(path, 64, what="weights file", error=CheckpointError)
    if not head.startswith(_ZIP_MAGIC) and _LEGACY_MAGIC not in head[:32]:
        kind = "a bare pickle" if head[:1] == b"\x80" else "neither a zip archive nor a legacy torch file"
        raise CheckpointError(
            f"{path} is {kind}, not a torch.save file: only torch.save files of tensors are read"
        )


def torch_load(path: Path) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` from a torch.save file, memory-mapped (nothing read yet)."""
    _check_torch_save_file(path)
    try:
        with warnings.catch_warnings():  # torch's notes on odd files: the error below says what matters
            warnings.simplefilter("ignore")
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # legacy (pre-zip) files cannot be mapped
                if "mmap" not in str(e):
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch's weights_only unpickler names the global
        if refused:
            raise CheckpointError(f"{path}: refusing to unpickle {refused.group(1)} (not tensor data)") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable PyTorch weights file: {first}") from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise CheckpointError(f"{path} does not hold a flat {{name: tensor}} state dict")
    return obj


def peek_keys(path: Path) -> list[str]:
    """The tensor names of a torch.save file (memory-mapped, so cheap on any size)."""
    sd = torch_load(path)
    keys = list(sd)
    del sd
    return keys


class TorchFiles:
    """Several torch.save files read as one name -> tensor map, memory-mapped."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.pages = PageReleaser()
        self.files: dict[Path, dict[str, torch.Tensor]] = {}
        for path in paths:
            self.files[path] = torch_load(path)
            self.pages.track(path)

    def close(self) -> None:
        for path in self.paths:
            self.pages.forget(path)
        self.files.clear()


def written_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype ``stored`` is written in when a conversion asks for ``dtype``: weights take
    it, integer state (a token -> experts table) keeps its own (a float would round its ids)."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    target = written_dtype(tensor.dtype, dtype)
    return tensor if tensor.dtype == target else tensor.to(target)


def torch_weight_files(folder: Path) -> list[Path]:
    """torch.save weight files of a folder, without optimizer/adapter side files."""
    skip = ("adapter", "recipe_state", "optimizer", "training_args")
    files = [
        p
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.suffix in (".pt", ".pth", ".bin") and not p.name.startswith(skip)
    ]
    return [check_inside(folder, p, str(folder)) for p in files]


class DictSource(Source):
    """An in-memory canonical state dict (e.g. ``model.state_dict()``) as a source."""

    format = "state_dict"

    def __init__(self, state_dict: dict[str, torch.Tensor], args: ModelArgs) -> None:
        super().__init__(Path("<state dict>"))
        self.state_dict = state_dict
        self._args = args

    def own_args(self) -> tuple[ModelArgs | None, str]:
        return self._args, "the given ModelArgs"

    def vocab_size(self, dim: int) -> int:
        return self.state_dict["tok_embeddings.weight"].shape[0]

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        infos = [
            TensorInfo(name, tuple(t.shape), t.dtype, name, "the state dict") for name, t in self.state_dict.items()
        ]
        check_complete(infos, args, origin, self.folder)
        self.infos = infos

    def load(self, name: str) -> torch.Tensor:
        return self.state_dict[name].detach()


class UntiedView(Source):
    """A bound source of a tied model seen as the untied model with the same weights: the output
    layer a copy of the embedding, for formats whose loaders expect both (Meta's, torchtune's,
    torchtitan's)."""

    def __init__(self, source: Source) -> None:
        super().__init__(source.folder)
        self.source, self.format, self.origin, self.notes = source, source.format, source.origin, source.notes
        self.aliases = tied_weights(source.args)  # {alias: the weight it is}
        self.args = source.args.replace(tie_embeddings=False)
        by_name = {info.name: info for info in source.infos}
        copies = [dataclasses.replace(by_name[of], name=alias) for alias, of in self.aliases.items()]
        self.infos = [*source.infos, *copies]

    def own_args(self) -> tuple[ModelArgs | None, str]:
        return self.args, self.origin

    def vocab_size(self, dim: int) -> int:
        return self.source.vocab_size(dim)

    def bind(self, args: ModelArgs, origin: str) -> None:
        raise TypeError("an UntiedView is made of a bound source")

    def load(self, name: str) -> torch.Tensor:
        return self.source.load(self.aliases.get(name, name))

    def extra_metadata(self) -> dict[str, Any]:
        return self.source.extra_metadata()
