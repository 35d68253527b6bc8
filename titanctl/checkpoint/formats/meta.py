"""Meta's original format: ``params.json`` + ``consolidated.NN.pth``, one file per model-parallel rank.

Meta's reference model (fairscale) shards every weight over its model-parallel ranks:
column-parallel layers (wq, wk, wv, w1, w3, output) split their output rows (dim 0),
row-parallel layers (wo, w2) their input columns (dim 1), Llama 3's
``VocabParallelEmbedding`` splits the vocabulary (dim 0; Llama 2's ``ParallelEmbedding``
split dim 1, which is read too), and the RMSNorm weights are replicated. 8B ships as
one file, 70B as 8, 405B as 8 or 16. The weights use the interleaved RoPE layout, as
titanctl does, so only the sharding changes.

torchtune's ``FullModelMetaCheckpointer`` writes the same names into one file
(``model-00001-of-00001.bin``, formerly ``meta_model_{epoch}.pt``): read as one shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from titanctl.checkpoint.formats.base import (
    DERIVED_BUFFERS,
    Progress,
    Source,
    TensorInfo,
    TorchFiles,
    cast,
    check_complete,
    read_json,
    torch_weight_files,
)
from titanctl.checkpoint.trust.model_args import check_args, check_declared
from titanctl.checkpoint.trust.paths import check_inside
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, RopeScaling

PARAMS_FILE = "params.json"
_SHARD_FILE = re.compile(r"consolidated\.(\d+)\.pth")
_COLUMN_PARALLEL = {"wq", "wk", "wv", "w1", "w3", "output"}
_ROW_PARALLEL = {"wo", "w2"}


def split_dim(name: str) -> int | None:
    """The dim Meta's model parallelism splits `name` along (None: replicated)."""
    module = name.rsplit(".", 2)[-2]  # layers.0.attention.wq.weight -> wq; output.weight -> output
    if module in _COLUMN_PARALLEL or module == "tok_embeddings":
        return 0
    if module in _ROW_PARALLEL:
        return 1
    return None


def shard_file(index: int) -> str:
    return f"consolidated.{index:02d}.pth"


# ----------------------------------------------------------------------------- params.json


def args_from_params(params: dict[str, Any], where: str = PARAMS_FILE) -> ModelArgs:
    """ModelArgs of Meta's params.json (Llama 3 / 3.1 keys; ``use_scaled_rope`` -> Llama 3.1 RoPE)."""
    try:
        scaling: RopeScaling | None = None
        if params.get("rope_scaling"):  # titanctl's extension for non-default scaling
            scaling = RopeScaling(**params["rope_scaling"])
        elif params.get("use_scaled_rope"):
            scaling = RopeScaling()
        multiplier = params.get("ffn_dim_multiplier")
        args = ModelArgs(
            dim=int(params["dim"]),
            n_layers=int(params["n_layers"]),
            n_heads=int(params["n_heads"]),
            n_kv_heads=int(params["n_kv_heads"]) if params.get("n_kv_heads") else None,
            vocab_size=int(params.get("vocab_size", -1)),
            multiple_of=int(params.get("multiple_of", 256)),
            ffn_dim_multiplier=float(multiplier) if multiplier is not None else None,
            norm_eps=float(params.get("norm_eps", 1e-5)),
            rope_theta=float(params.get("rope_theta", 500000.0)),
            rope_scaling=scaling,
        )
    except KeyError as e:
        raise CheckpointError(f"{where} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{where} has an invalid value: {e}") from None
    if args.vocab_size == -1:  # Llama 2's params.json; the caller takes it from the embedding
        return check_args(args.replace(vocab_size=1), where).replace(vocab_size=-1)
    return check_args(args, where)


def params_from_args(args: ModelArgs) -> dict[str, Any]:
    """Meta's params.json for `args` (Meta's own key set; key order as Meta publishes it)."""
    params: dict[str, Any] = {"dim": args.dim}
    if args.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    params.update(
        multiple_of=args.multiple_of,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        n_layers=args.n_layers,
        norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        use_scaled_rope=args.rope_scaling is not None,
        vocab_size=args.vocab_size,
    )
    if args.rope_scaling is not None and args.rope_scaling != RopeScaling():
        # Meta's keys can only say "Llama 3.1's scaling": keep any other scaling exactly.
        params["rope_scaling"] = {
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_position_embeddings,
        }
    return params



# ----------------------------------------------------------------------------- reading


def find_files(folder: Path) -> list[Path]:
    shards = {}
    for path in folder.iterdir():
        m = _SHARD_FILE.fullmatch(path.name)
        if m:
            shards[int(m.group(1))] = check_inside(folder, path, str(folder))
    if shards:
        missing = [i for i in range(max(shards) + 1) if i not in shards]
        if missing:
            raise CheckpointError(f"{folder} lacks {shard_file(missing[0])} (has {len(shards)} shard files)")
        return [shards[i] for i in range(len(shards))]
    others = torch_weight_files(folder)
    if len(others) == 1:  # torchtune's Meta checkpointer: one file of Meta names
        return others
    if others:
        names = ", ".join(p.name for p in others[:3])
        raise CheckpointError(f"{folder} has no consolidated.*.pth and several weight files ({names}): which one?")
    raise CheckpointError(f"{folder} has no consolidated.*.pth: not a Meta checkpoint")


class MetaSource(Source):
    format = "meta"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.paths = find_files(self.folder)
        self.files = TorchFiles(self.paths)
        self.shards = [self.files.files[p] for p in self.paths]
        self.dims: dict[str, int | None] = {}

    def own_args(self) -> tuple[ModelArgs | None, str]:
        path = self.folder / PARAMS_FILE
        if not path.is_file():
            return None, PARAMS_FILE
        args = args_from_params(read_json(path), str(path))
        if args.vocab_size <= 0:  # Llama 2's params.json says -1
            args = args.replace(vocab_size=self.vocab_size(args.dim))
        stored = ((name, tuple(t.shape)) for shard in self.shards for name, t in shard.items())
        check_declared(args, stored, self.embedding_rows(args.dim), str(path))
        return args, PARAMS_FILE

    def _embedding_split(self, dim: int) -> int | None:
        if len(self.shards) == 1:
            return None
        first = self.shards[0].get("tok_embeddings.weight")
        if first is None or first.ndim != 2:
            return 0
        return 0 if first.shape[1] == dim else 1

    def vocab_size(self, dim: int) -> int:
        parts = [s.get("tok_embeddings.weight") for s in self.shards]
        if any(p is None or p.ndim != 2 for p in parts):
            raise CheckpointError(f"{self.paths[0]} has no 2-D 'tok_embeddings.weight'")
        if self._embedding_split(dim) == 0:
            return sum(p.shape[0] for p in parts)
        return parts[0].shape[0]

    def _where(self) -> str:
        if len(self.paths) == 1:
            return self.paths[0].name
        return f"{shard_file(0)}..{shard_file(len(self.paths) - 1)}"

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        first = self.shards[0]
        keys = [k for k in first if k not in DERIVED_BUFFERS]
        for path, shard in zip(self.paths[1:], self.shards[1:]):
            extra = set(shard) - set(first)
            lacking = set(keys) - set(shard)
            if extra or lacking:
                name = sorted(extra or lacking)[0]
                has, lacks = (path, self.paths[0]) if extra else (self.paths[0], path)
                raise CheckpointError(f"{has.name} has tensor {name!r} that {lacks.name} lacks")
        infos = []
        for key in keys:
            parts = [s[key] for s in self.shards]
            dim = self._embedding_split(args.dim) if key == "tok_embeddings.weight" else split_dim(key)
            if len(parts) == 1:
                dim = None
            shape = list(parts[0].shape)
            for path, part in zip(self.paths[1:], parts[1:]):
                if part.dtype != parts[0].dtype:
                    raise CheckpointError(
                        f"tensor {key!r} is {part.dtype} in {path.name} but {parts[0].dtype} in {self.paths[0].name}"
                    )
                same = part.ndim == len(shape) and all(
                    a == b for d, (a, b) in enumerate(zip(part.shape, parts[0].shape)) if d != dim
                )
                if not same:
                    raise CheckpointError(
                        f"tensor {key!r} has shape {tuple(part.shape)} in {path.name} but "
                        f"{tuple(parts[0].shape)} in {self.paths[0].name}"
                    )
                if dim is not None:
                    shape[dim] += part.shape[dim]
            self.dims[key] = dim
            infos.append(TensorInfo(key, tuple(shape), parts[0].dtype, key, self._where()))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos

    def load(self, name: str) -> torch.Tensor:
        parts = [s[name] for s in self.shards]
        dim = self.dims[name]
        pages = self.files.pages
        if dim is None:
            for path, part in zip(self.paths[1:], parts[1:]):
                if not torch.equal(part, parts[0]):
                    raise CheckpointError(
                        f"replicated tensor {name!r} differs between {self.paths[0].name} and {path.name}"
                    )
                pages.release(part)
            return pages.copy_out(parts[0])
        out = torch.empty(self.info(name).shape, dtype=parts[0].dtype)
        start = 0
        for part in parts:  # each shard's slice straight into place: no second full-size copy
            pages.copy_into(out.narrow(dim, start, part.shape[dim]), part)
            start += part.shape[dim]
        return out

    def load_slice(self, name: str, index: int, count: int) -> torch.Tensor | None:
        if count != len(self.shards) or count == 1 or self.dims[name] != split_dim(name):
            return None
        return self.files.pages.copy_out(self.shards[index][name])

    def close(self) -> None:
        self.shards = []
        self.files.close()


# ----------------------------------------------------------------------------- writing


def check_splittable(args: ModelArgs, source: Source, shards: int) -> None:
    if shards < 1:
        raise CheckpointError(f"--shards must be at least 1, got {shards}")
    if shards == 1:
        return
    for what, count in (("attention heads", args.n_heads), ("KV heads", args.kv_heads)):
        if count % shards:
            raise CheckpointError(f"cannot split {count} {what} over {shards} model-parallel shards")
    for info in source.infos:
        dim = split_dim(info.name)
        if dim is not None and info.shape[dim] % shards:
            raise CheckpointError(
                f"cannot split tensor {info.name!r} {info.shape} into {shards} shards along dim {dim}"
            )


def write(
    folder: Path,
    args: ModelArgs,
    source: Source,
    *,
    dtype: torch.dtype | None,
    progress: Progress,
    shards: int = 1,
) -> None:
    """One pass over the source per output shard, so only one shard is ever in memory."""
    check_splittable(args, source, shards)
    for index in range(shards):
        tensors = {}
        for info in source.infos:
            part = source.load_slice(info.name, index, shards)
            if part is None:
                full = source.load(info.name)
                dim = split_dim(info.name)
                part = full if dim is None or shards == 1 else full.chunk(shards, dim)[index].clone()
                del full
            tensors[info.name] = cast(part, dtype)
            progress(info.name, tensors[info.name].nbytes)
        torch.save(tensors, folder / shard_file(index))
        del tensors
    (folder / PARAMS_FILE).write_text(json.dumps(params_from_args(args), indent=2) + "\n")
