"""Hugging Face model folders written while training, straight from the sharded model.

``checkpoint.save_format = "hf"`` or ``"both"``, and ``checkpoint.last_save_in_hf``, make a save
write ``{checkpoint folder}/step-{N}-hf/``: what ``titanctl convert --to hf`` writes from a step
folder (config.json, generation_config.json, safetensors shards + their index, the run's tokenizer
files), made by the same writer (``formats.hf.write``) from a source that is the live model. A run
whose weights came from a Hugging Face folder (directly, or through a converted DCP checkpoint) writes
that folder's config.json back, and its file names and shards, as ``convert`` does (the manager keeps
both, ``hf.carried_config`` and ``hf.names.HF_FILES_KEY``).

One tensor at a time. Every rank walks the same list of canonical names, in the order the writer
asks for them (``formats.hf.write_order``). For each name, the ranks that hold it (every rank, or
those of one pipeline stage) gather it to a full tensor (``DTensor.full_tensor``: a collective on
that stage's own mesh); the lowest of them casts it to the export dtype and, unless it is rank 0,
sends it to rank 0 over the checkpoint's gloo group. Rank 0 hands it to the writer, which keeps it
only until its output shard is written. So rank 0 holds at most one output shard (5 GB) and one
full tensor, every other rank at most one full tensor; there is no DCP save and no reconversion.

HF folders hold weights only: resuming needs a DCP step (``checkpoint.run.load_plan`` says so).
The folder's lifecycle (temporary name, rename, retention) is the manager's, as for DCP steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanctl.checkpoint.formats import hf
from titanctl.checkpoint.formats.base import Source, TensorInfo, no_progress, written_dtype
from titanctl.checkpoint.hf.tokenizer_export import resolve_tokenizer, write_companion_files
from titanctl.checkpoint.run.carried import CarriedTensors
from titanctl.checkpoint.run.state import ModelState
from titanctl.checkpoint.trust.reader import one_line
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import tied_weights, weight_shapes

HF_STEP_FOLDER = re.compile(r"step-(\d+)-hf")
WRITER = 0  # the rank that writes the files


def hf_folder_name(step: int) -> str:
    return f"step-{step}-hf"


def hf_saves(root: Path) -> dict[int, Path]:
    """{step: folder} of a run's Hugging Face saves under ``root`` (temporary folders ignored)."""
    try:
        found = {
            int(m.group(1)): child
            for child in (Path(root).iterdir() if Path(root).is_dir() else ())
            if (m := HF_STEP_FOLDER.fullmatch(child.name)) and child.is_dir()
        }
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint folder {root}: {e.strerror or e}") from None
    return dict(sorted(found.items()))


def only_hf_saves_error(root: Path) -> CheckpointError | None:
    """What resuming a run whose folder holds Hugging Face saves but no DCP step runs into."""
    saves = hf_saves(root)
    if not saves:
        return None
    newest = list(saves.values())[-1]
    return CheckpointError(
        f"{root} holds only Hugging Face saves (newest {newest.name}), which hold weights only: a run cannot "
        f"resume from them (save_format = 'both' or 'dcp' writes resumable steps). To train on from those "
        f"weights, start a new job.dump_folder with checkpoint.initial_load_path = {str(newest)!r}"
    )


def newer_hf_saves_note(root: Path, step: int) -> str | None:
    """A note when the run resumes from DCP step ``step`` but has newer (weights-only) HF saves."""
    newer = [folder.name for s, folder in hf_saves(root).items() if s > step]
    if not newer:
        return None
    return (
        f"note: resuming from step-{step}, the newest DCP step; {', '.join(newer)} hold(s) weights only "
        "(Hugging Face saves) and cannot resume training"
    )


def run_tokenizer(tokenizer_path: str, args: ModelArgs) -> Tokenizer:
    """The tokenizer whose files an HF save carries: the run's own (checked against the model's
    vocabulary when the run starts, not at its end)."""
    # With a path given, resolve_tokenizer reads no checkpoint (the source argument is for recorded paths).
    tokenizer, _recorded, _said = resolve_tokenizer(None, args, tokenizer_path or DEFAULT_TOKENIZER_PATH)
    return tokenizer


class _Gatherer:
    """Brings the tensors of this rank's model parts to rank 0 as full tensors, one at a time, in
    ``order``; every rank calls ``next`` for every name of ``order``, in order."""

    def __init__(
        self, local: dict[str, torch.Tensor], order: list[str], holders: dict[str, list[int]],
        dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]], rank: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.local, self.order, self.holders, self.dtypes, self.shapes = local, order, holders, dtypes, shapes
        self.rank, self.group = rank, group
        self.pos = 0

    def next(self, name: str) -> torch.Tensor | None:
        """The full tensor ``name`` on rank 0 (cast to its export dtype), None elsewhere."""
        if self.pos >= len(self.order) or self.order[self.pos] != name:
            expected = self.order[self.pos] if self.pos < len(self.order) else "nothing"
            raise RuntimeError(f"HF save asked for {name!r} out of order (expected {expected})")
        self.pos += 1
        holders = self.holders[name]
        source = holders[0]
        full = None
        if self.rank in holders:
            tensor = self.local[name]
            if tensor.dtype != self.dtypes[name]:  # cast the shard: a bf16 export gathers half the bytes
                tensor = tensor.to(self.dtypes[name])
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # every holder: a collective on its stage's mesh
            if self.rank == source:
                full = tensor.detach().to("cpu", self.dtypes[name]).contiguous()
            del tensor
        if source == WRITER:
            return full
        if self.rank == source:  # another stage's tensor goes to the writer
            dist.send(full, dst=WRITER, group=self.group)
            return None
        if self.rank == WRITER:
            full = torch.empty(self.shapes[name], dtype=self.dtypes[name])
            dist.recv(full, src=source, group=self.group)
            return full
        return None

    def finish(self) -> None:
        """Take part in the rest of the walk (rank 0 after a failed write: the other ranks go on)."""
        while self.pos < len(self.order):
            self.next(self.order[self.pos])


class _LiveModel(Source):
    """The model being trained, seen by the writer on rank 0 as a checkpoint source."""

    format = "training run"

    def __init__(self, folder: Path, args: ModelArgs, infos: list[TensorInfo], gatherer: _Gatherer,
                 carried: CarriedTensors | None = None) -> None:
        super().__init__(folder)
        self.args, self.origin, self.infos = args, "the run's model", infos
        self.gatherer = gatherer
        self.carried = carried.infos if carried else []
        self.carried_values = carried.values if carried else {}

    def own_args(self) -> tuple[ModelArgs | None, str]:
        return self.args, self.origin

    def vocab_size(self, dim: int) -> int:
        return self.args.vocab_size

    def bind(self, args: ModelArgs, origin: str) -> None:
        raise TypeError("the live model is bound when it is made")

    def load(self, name: str) -> torch.Tensor:
        return self.gatherer.next(name)

    def load_carried(self, name: str) -> torch.Tensor:
        return self.carried_values[name]


def write_hf_folder(
    tmp: Path, model: ModelState, args: ModelArgs, *, tokenizer: Tokenizer | None, dtype: torch.dtype | None,
    rank: int, world_size: int, group: dist.ProcessGroup | None, source_config: dict | None = None,
    layout: dict | None = None, carried: CarriedTensors | None = None,
) -> str | None:
    """Every rank, at the same point: rank 0 writes the HF model folder into ``tmp`` (made already).
    ``source_config``: the Hugging Face config.json the run's weights came from, if they did (written
    back while it describes the model: ``hf.carried_config``); ``layout``: that folder's files
    (``formats.hf.file_layout``), written again, with the tensors the run ``carried`` from it as they are
    (``run.carried``: rank 0 holds them). Returns, on rank 0, why the write failed (None: it did not);
    None on the other ranks."""
    local = model.state_dict()  # this rank's (sharded) tensors under canonical names: no copies
    mine = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in local.items()}
    everyone = [mine]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
    aliases = tied_weights(args)  # HF stores a tied output layer once, as the embedding
    names = [name for name in weight_shapes(args) if name not in aliases]
    holders = {name: [r for r, held in enumerate(everyone) if name in held] for name in names}
    orphans = [name for name, ranks in holders.items() if not ranks]
    if orphans:
        raise RuntimeError(f"no rank holds {orphans[:3]} of the model")
    first = {name: everyone[ranks[0]][name] for name, ranks in holders.items()}
    dtypes = {name: written_dtype(getattr(torch, held[0]), dtype) for name, held in first.items()}
    shapes = {name: held[1] for name, held in first.items()}
    infos = [TensorInfo(name, shapes[name], getattr(torch, first[name][0]), name, "the run's model") for name in names]
    gatherer = _Gatherer(local, [], holders, dtypes, shapes, rank, group)
    source = _LiveModel(tmp, args, infos, gatherer, carried)
    gatherer.order = order = hf.write_order(names, args, layout,
                                            [info.name for info in hf.carried_written(source, layout, False)])
    if rank != WRITER:
        gatherer.finish()
        return None
    try:
        token_ids = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer is not None else None
        hf.write(tmp, args, source, dtype=dtype, progress=no_progress, token_ids=token_ids,
                 source_config=source_config, layout=layout)
        write_companion_files(tmp, "hf", args, tokenizer)
        if gatherer.pos != len(order):
            raise RuntimeError(f"the writer took {gatherer.pos} of {len(order)} tensors")
    except Exception as e:
        gatherer.finish()
        return one_line(e)
    return None


__all__ = [
    "HF_STEP_FOLDER", "hf_folder_name", "hf_saves", "newer_hf_saves_note", "only_hf_saves_error",
    "run_tokenizer", "write_hf_folder",
]
