"""Hugging Face model folders (``*ForCausalLM`` of every family): ``config.json`` + safetensors shards + their index.

Names, the q/k row permutation and config.json come from ``titanctl.checkpoint.hf.names``
(one tensor at a time). Reading opens one safetensors file at a time, lazily; block-quantized FP8
weights (DeepSeek-V3's release: ``X.weight`` in float8 beside ``X.weight_scale_inv``) are paired
with their scales from the headers and dequantized as each is loaded (``titanctl.checkpoint.quantized.fp8_blocks``)
to the source's ``dequantize_to``, and so are MXFP4 matrices (gpt-oss's release: ``X_blocks`` beside
``X_scales``, read as the tensor ``X`` they encode: ``titanctl.checkpoint.quantized.mxfp4``);
writing holds one output shard (``--max-shard-size``) and one source tensor at a time. The output
is what ``save_pretrained`` writes: routed experts one tensor per expert (the Hub's layout; a folder
of transformers 5's packed ``mlp.experts.gate_up_proj`` reads too), one ``model.safetensors`` with no
index when the model fits one shard, else ``model-00001-of-0000N.safetensors`` files and
``model.safetensors.index.json``, which transformers 4.x and 5.x load, and the source's own
config.json where the model came from one (``titanctl.checkpoint.hf.carried_config``). A model that
came from a Hugging Face folder goes back into that folder's files (``HF_FILES_KEY``: which file held
each tensor, carried as its config.json is), as long as they hold exactly the tensors written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titanctl.checkpoint.formats.base import (
    PageReleaser,
    Progress,
    Source,
    TensorInfo,
    cast,
    check_complete,
    dtype_name,
    read_json,
    written_dtype,
)
from titanctl.checkpoint.hf import hub_layout
from titanctl.checkpoint.hf.carried_config import HF_CONFIG_KEY, carried, export_config
from titanctl.checkpoint.hf.hub_layout import REQUANTIZED_KEY, HubNaming
from titanctl.checkpoint.hf.names import (
    HF_FILES_KEY,
    IGNORED_HF_SUFFIXES,
    Piece,
    args_from_hf_config,
    canonical_name_of,
    check_one_expert_layout,
    from_hf_tensor,
    hf_names_of,
    hub_names_of,
    not_stored,
    shared_copy,
    special_token_ids,
    structured_pieces,
    to_hub_tensors,
)
from titanctl.checkpoint.quantized import fp4_experts, mxfp4, requantize
from titanctl.checkpoint.quantized.fp8_blocks import (
    DEFAULT_BLOCK,
    PUBLISHED_SCALE_SUFFIX,
    SCALE_SUFFIX,
    BlockScale,
    check_scale_values,
    declared_block_size,
    dequantize,
    pair_scales,
    published_scale_names,
)
from titanctl.checkpoint.trust.model_args import check_declared
from titanctl.checkpoint.trust.paths import check_inside, inside
from titanctl.checkpoint.trust.shape_inference import infer_model_args
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import num_params, weight_shapes
from titanctl.safe_io import regular_file_size

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # save_pretrained's name for a model in one shard (then no index)
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # the Hub's customary 5GB
MAX_CARRIED_CONFIG_BYTES = 1 << 20  # published configs are a few kB
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's UE8M0 block scales
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def holds_hf_names(folder: Path) -> bool:
    """Whether the first safetensors file of `folder` holds Hugging Face Llama names (headers only)."""
    files = sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())  # a FIFO would block
    try:
        with safe_open(str(files[0]), framework="pt") as f:
            return any(canonical_name_of(hub_layout.text_name(key)) is not None for key in f.keys())
    except (IndexError, SafetensorError, OSError):
        return False


class HFSource(Source):
    format = "hf"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map")
            # Every file the index names must lie inside the folder (no /etc/passwd, no ../..).
            files = list(dict.fromkeys(inside(self.folder, f, str(index)) for f in weight_map.values()))
            for path in files:
                if not path.is_file():
                    raise CheckpointError(f"{index} names {path.name}, which is missing")
        else:
            weight_map = None
            files = [check_inside(self.folder, p, str(self.folder)) for p in sorted(self.folder.glob("*.safetensors"))]
            if not files:
                bins = sorted(p.name for p in self.folder.glob("*.bin"))
                hint = f" ({bins[0]} is PyTorch .bin: load and save_pretrained it as safetensors)" if bins else ""
                raise CheckpointError(f"{self.folder} has no *.safetensors weights{hint}")
        # (HF name, file, shape, dtype) from the safetensors headers: no tensor is read here.
        self.raw: list[tuple[str, Path, tuple[int, ...], torch.dtype]] = []
        for path in files:
            regular_file_size(path, what="safetensors file", error=CheckpointError)  # a FIFO would block
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if weight_map is not None and self.folder / weight_map.get(key, "") != path:
                            raise CheckpointError(f"{path.name} holds {key!r}, which {INDEX_FILE} puts elsewhere")
                        piece = f.get_slice(key)
                        dtype = _DTYPES.get(piece.get_dtype())
                        if dtype is None:
                            raise CheckpointError(
                                f"tensor {key!r} in {path.name} has unsupported dtype {piece.get_dtype()}"
                            )
                        self.raw.append((key, path, tuple(piece.get_shape()), dtype))
            except SafetensorError as e:
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        if weight_map is not None:
            present = {key for key, *_ in self.raw}
            absent = [key for key in weight_map if key not in present]
            if absent:
                raise CheckpointError(f"{weight_map[absent[0]]} lacks {absent[0]!r}, which {INDEX_FILE} lists")
        self._unwrap()
        self._pair_block_scales()
        self._pair_mxfp4_blocks()
        self.pages = PageReleaser()
        self._open_path: Path | None = None
        self._open_file: Any = None

    def _unwrap(self) -> None:
        """A vision-language folder (``hub_layout``): its text model's tensors renamed as the ``*ForCausalLM``
        spells them (``_stored`` maps back), the parts titanctl does not build set aside: a wrapper's carried as stored
        (``carried``, ``load_carried``); a plain ``save_pretrained`` folder's are left unread (``left_out``). A
        published folder's prediction depths (DeepSeek-V4's ``mtp.{k}.*``) are read as layers n_layers + k;
        ``bind`` carries those the model lacks."""
        self._stored: dict[str, str] = {}  # name in raw -> name in the file, where they differ
        self._carried_files: dict[str, Path] = {}
        self.left_out: list[str] = []  # a plain folder's parts titanctl does not build: not read
        self.naming = HubNaming()
        keys = [key for key, *_ in self.raw]
        if hub_layout.is_wrapped(keys):
            self.naming = HubNaming(hub_layout.WRAPPED_PREFIX)
        else:  # perhaps a family's published folder without the model. prefix; else save_pretrained's names
            config = self.folder / CONFIG_FILE
            naming = hub_layout.published_naming(keys, read_json(config) if config.is_file() else {})
            if naming is not None:
                self.naming = naming
        # A published folder's prediction depths (mtp.{k}.*) are read as layers n_layers + k, as save_pretrained
        # names them; ``bind`` carries those the model does not have, as stored (``_published_depths``).
        n_layers = self._declared_layers() if self.naming.prefix == hub_layout.UNPREFIXED else None
        self._published_depths: dict[str, tuple[str, Path, tuple[int, ...], torch.dtype]] = {}
        kept = []
        for key, path, shape, dtype in self.raw:
            if n_layers is not None and key.startswith(hub_layout.PUBLISHED_DEPTH):
                name = self.naming.text_name(key, n_layers)
                self._stored[name] = key
                self._published_depths[name] = (key, path, shape, dtype)
                kept.append((name, path, shape, dtype))
                continue
            if hub_layout.not_built(key) and self.naming.plain:
                self.left_out.append(key)
                continue
            if hub_layout.not_built(key):
                self.carried.append(TensorInfo(key, shape, dtype, key, str(path.relative_to(self.folder))))
                self._carried_files[key] = path
                continue
            name = self.naming.text_name(key)
            if name != key:
                self._stored[name] = key
            kept.append((name, path, shape, dtype))
        self.raw = kept

    def _declared_layers(self) -> int | None:
        """config.json's num_hidden_layers (None without one): where a published folder's depths begin."""
        config = self.folder / CONFIG_FILE
        found = read_json(config).get("num_hidden_layers") if config.is_file() else None
        return found if isinstance(found, int) and not isinstance(found, bool) and found >= 0 else None

    def _tensor(self, path: Path, key: str) -> torch.Tensor:
        """The stored tensor of a name in ``raw`` (memory-mapped)."""
        return self._file(path).get_tensor(self._stored.get(key, key))

    def _pair_block_scales(self) -> None:
        """Take the FP8 weights' scales out of ``raw`` (they are no weights) into ``scales``, every
        pairing and shape checked from the headers, before any tensor is read or written."""
        config = self.folder / CONFIG_FILE
        config_json = read_json(config) if config.is_file() else None
        declared = declared_block_size(config_json, str(config)) if config.is_file() else None
        self.block = declared or DEFAULT_BLOCK
        renames = published_scale_names(self.raw)  # DeepSeek-V4's X.scale, read as X.weight_scale_inv
        for key, name in renames.items():
            self._stored[name] = self._stored.pop(key, key)
        self.raw = [(renames.get(key, key), *rest) for key, *rest in self.raw]
        self.fp4 = self._pair_fp4_experts(fp4_experts.declared(config_json))
        fp4_keys = {key for pair in self.fp4.items() for key in (pair[0], pair[1].key)}
        fp8 = pair_scales([entry for entry in self.raw if entry[0] not in fp4_keys], self.block, self.folder,
                          self._stored)
        self.scales: dict[str, BlockScale] = {**fp8, **self.fp4}
        scale_keys = {scale.key for scale in self.scales.values()}
        self._carry_power_of_two_scales(scale_keys)
        self.raw = [entry for entry in self.raw if entry[0] not in scale_keys]

    def _carry_power_of_two_scales(self, scale_keys: set[str]) -> None:
        """UE8M0 block scales (DeepSeek-V4's release) are carried as stored (``Source.carried``): a Hugging Face
        export divides its weights by them again (``quantized.requantize``), which gives back the stored FP8 and
        FP4 bytes of untouched weights, and writes them and the release's quantization keys back."""
        carried = [(key, path, shape) for key, path, shape, dtype in self.raw
                   if key in scale_keys and dtype == requantize.UE8M0]
        for key, path, shape in carried:
            stored = self._stored.get(key, key)
            self.carried.append(TensorInfo(stored, shape, requantize.UE8M0, stored, str(path.relative_to(self.folder))))
            self._carried_files[stored] = path
        if carried:
            self.notes.append(f"{len(carried)} UE8M0 block scales carried as stored: a Hugging Face export writes its "
                              "FP8 and FP4 weights against them again, in the release's format (bit for bit when "
                              "untouched)")

    def _pair_fp4_experts(self, declared: bool) -> dict[str, BlockScale]:
        """DeepSeek-V4's packed FP4 experts (``fp4_experts``: int8 beside their UE8M0 scales, when config.json
        declares ``expert_dtype: fp4``): paired, shapes and scales checked, and put in ``raw`` as the weight
        each holds (its unpacked shape), apart from the block-FP8 pairs."""
        by_key = {key: (path, shape, dtype) for key, path, shape, dtype in self.raw}
        pairs: dict[str, BlockScale] = {}
        for key, path, shape, dtype in self.raw:
            scale_key = key + SCALE_SUFFIX
            if dtype != fp4_experts.PACKED_DTYPE or scale_key not in by_key:
                continue
            where = str(path.relative_to(self.folder))
            if not declared:
                raise CheckpointError(f"tensor {self._stored.get(key, key)!r} in {where} is int8 beside block scales "
                                      f"(packed FP4), but config.json does not declare expert_dtype "
                                      f"{fp4_experts.EXPERT_DTYPE!r}")
            scale_path, scale, scale_dtype = by_key[scale_key]
            fp4_experts.check_pair(key, shape, scale_key, scale, where)
            if not scale_dtype.is_floating_point:
                raise CheckpointError(f"tensor {scale_key!r} in {where} is {dtype_name(scale_dtype)}: FP4 scales are "
                                      "real numbers (UE8M0, float8_e8m0fnu, as DeepSeek-V4 stores them)")
            pairs[key] = BlockScale(scale_key, scale_path)
        check_scale_values(pairs, self.folder, self._stored)
        self.raw = [(key, path, fp4_experts.unpacked_shape(shape) if key in pairs else shape, dtype)
                    for key, path, shape, dtype in self.raw]
        return pairs

    def _pair_mxfp4_blocks(self) -> None:
        """Take MXFP4 blocks and scales out of ``raw`` and put in their place the tensor each pair
        encodes, under its name and shape (``titanctl.checkpoint.quantized.mxfp4``), every pairing, shape and
        exponent checked, before any tensor is read or written."""
        config = self.folder / CONFIG_FILE
        declares = mxfp4.declared(read_json(config)) if config.is_file() else False
        self.mxfp4: dict[str, mxfp4.Packed] = mxfp4.pair_blocks(self.raw, self.folder, declares)
        packed_keys = {key for entry in self.mxfp4.values() for key in (entry.blocks, entry.scales)}
        self.raw = [entry for entry in self.raw if entry[0] not in packed_keys]
        self.raw += [(entry.name, entry.blocks_path, entry.shape, torch.uint8) for entry in self.mxfp4.values()]

    def _loaded_dtype(self, key: str, stored: torch.dtype) -> torch.dtype:
        """The dtype ``load`` gives a stored tensor: an FP8 or MXFP4 weight's is ``dequantize_to``."""
        return self.dequantize_to if key in self.scales or key in self.mxfp4 else stored

    def own_args(self) -> tuple[ModelArgs | None, str]:
        if not (self.folder / CONFIG_FILE).is_file():  # e.g. torchtitan's own HF save: safetensors only
            shapes = {canonical_name_of(key): shape for key, _path, shape, _dtype in self.raw}
            return infer_model_args(shapes, f"{self.folder} (no {CONFIG_FILE})")
        where = str(self.folder / CONFIG_FILE)
        config = read_json(self.folder / CONFIG_FILE)
        args = args_from_hf_config(config, where=where)
        if self.naming.wrapped and self.carried:
            self.notes.append(hub_layout.carried_note([info.name for info in self.carried], config))
        if self.left_out:
            self.notes.append(hub_layout.unread_note(self.left_out, hub_layout.unwrapped_config(config).get(
                "architectures", ["the *ForCausalLM"])[0]))
        if args.mtp_layers and not any(_layer_of(key) >= args.n_layers for key, *_ in self.raw):
            # transformers writes DeepSeek-V3's num_nextn_predict_layers (default 1) without the weights.
            args = args.replace(mtp_layers=0)
        stored = ((key, shape) for key, _path, shape, _dtype in self.raw)
        check_declared(args, stored, self.embedding_rows(args.dim), where)
        return args, CONFIG_FILE

    def vocab_size(self, dim: int) -> int:
        for key, _path, shape, _dtype in self.raw:
            if key == "model.embed_tokens.weight" and len(shape) == 2:
                return shape[0]
        raise CheckpointError(f"{self.folder} has no 2-D 'model.embed_tokens.weight'")

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        infos = []
        self._structured: dict[str, list[tuple[Piece, str, Path]]] = {}  # packed or per-expert weights
        check_one_expert_layout((key for key, *_ in self.raw), args)
        if self.naming.wrapped:  # the Hub's wrappers pack their experts; an export keeps the folder's layout
            packed = any(structured_pieces(key, args)[:1] and structured_pieces(key, args)[0].expert is None
                         for key, *_ in self.raw)
            self.naming = HubNaming(self.naming.prefix, packed)
        unused_depths = self._unused_prediction_depths(args)
        for key, path, shape, dtype in self.raw:
            if key.endswith(IGNORED_HF_SUFFIXES) or shared_copy(key, args) or _layer_of(key) in unused_depths:
                continue
            pieces = structured_pieces(key, args)
            for piece in pieces:
                self._structured.setdefault(piece.name, []).append((piece, key, path))
            if pieces:
                continue
            dtype = self._loaded_dtype(key, dtype)
            try:  # names, shape check and permuted shape, all on the meta device
                name, canonical = from_hf_tensor(key, torch.empty(shape, dtype=dtype, device="meta"), args)
            except CheckpointError as e:
                raise CheckpointError(f"{path.name}: {e} (model from {origin})") from None
            infos.append(TensorInfo(name, tuple(canonical.shape), dtype, key, str(path.relative_to(self.folder))))
        shapes = {key: (shape, self._loaded_dtype(key, dtype)) for key, _path, shape, dtype in self.raw}
        for name, found in self._structured.items():
            infos.append(self._structured_info(name, found, shapes))
        for name, shape in weight_shapes(args).items():
            if not_stored(name, args):  # e.g. an expert bias: starts at zero
                infos.append(TensorInfo(name, shape, torch.float32, name, "(not stored: zeros)"))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos
        if len(self.scales) > len(self.fp4):
            self.notes.append(
                f"{len(self.scales) - len(self.fp4)} FP8 weights dequantized to {dtype_name(self.dequantize_to)} "
                f"with their {self.block[0]}x{self.block[1]} block scales (weight_scale_inv, or DeepSeek-V4's .scale)"
            )
        if self.fp4:
            self.notes.append(f"{len(self.fp4)} FP4 expert weights (int8, two E2M1 values a byte) dequantized "
                              f"exactly to {dtype_name(self.dequantize_to)} with their scales (one per "
                              f"{fp4_experts.GROUP} values)")
        if self.mxfp4:
            mxfp4.check_dtype(self.dequantize_to)
            self.notes.append(f"{len(self.mxfp4)} MXFP4 weights (*_blocks, *_scales) dequantized exactly to "
                              f"{dtype_name(self.dequantize_to)}")

    def _unused_prediction_depths(self, args: ModelArgs) -> list[int]:
        """The layers of multi-token-prediction depths that the files hold beyond the model's own
        (``model.mtp_layers``; DeepSeek-V3 publishes one): left unread, with a note. A depth that
        config.json declares without its weights (as transformers saves DeepSeek-V3) is no news. A published
        folder's depths beyond the model's (DeepSeek-V4's ``mtp.{k}.*``) are carried instead, declared or not."""
        if self._published_depths:  # a published folder's depths beyond the model's are carried, declared or not
            beyond = {layer for name in self._published_depths
                      if (layer := _layer_of(name)) >= args.n_layers + args.mtp_layers}
            if beyond:
                self._carry_published_depths(beyond)
            return sorted(beyond)
        config = self.folder / CONFIG_FILE
        declared = read_json(config).get("num_nextn_predict_layers") if config.is_file() else 0
        if not isinstance(declared, int) or isinstance(declared, bool):  # a config read with --flavor is unchecked
            declared = 0
        depths = range(args.n_layers + args.mtp_layers, args.n_layers + declared)
        unused = sorted({layer for key, *_ in self.raw if (layer := _layer_of(key)) in depths})
        if unused:
            which = f"layer {unused[0]}" if len(unused) == 1 else f"layers {', '.join(map(str, unused))}"
            self.notes.append(f"the checkpoint's multi-token-prediction {which} not loaded: this model has "
                              f"model.mtp_layers = {args.mtp_layers}")
        return unused

    def _carry_published_depths(self, layers: set[int]) -> None:
        """The published folder's depths beyond the model's (``mtp.{k}.*``) carried as stored, as its other parts
        are (their UE8M0 scales are already): an export writes them back unchanged."""
        carried = [stored for name, stored in self._published_depths.items() if _layer_of(name) in layers]
        known = {info.name for info in self.carried}
        for key, path, shape, dtype in carried:
            if key not in known:
                self.carried.append(TensorInfo(key, shape, dtype, key, str(path.relative_to(self.folder))))
                self._carried_files[key] = path
        for name in [name for name in self.scales if _layer_of(name) in layers]:
            del self.scales[name]
            self.fp4.pop(name, None)
        self.notes.append(hub_layout.published_carried_note([key for key, *_ in carried]))

    def extra_metadata(self) -> dict[str, Any]:
        """config.json, carried into a DCP output and back into Hugging Face exports."""
        config = self.folder / CONFIG_FILE
        if not config.is_file():
            return {}
        if regular_file_size(config, what="config.json", error=CheckpointError) > MAX_CARRIED_CONFIG_BYTES:
            # titanctl.json, which carries it, is read back with a size limit: no model's config is this big.
            raise CheckpointError(f"{config} is larger than {MAX_CARRIED_CONFIG_BYTES >> 20} MiB: not a model's config")
        found = read_json(config)
        return {HF_CONFIG_KEY: carried(hub_layout.unwrapped_config(found)), HF_FILES_KEY: self._layout(found)}

    def _layout(self, config: dict[str, Any]) -> dict[str, Any]:
        """The folder's layout: which file holds each stored tensor (``file_layout``: the model's and the
        carried ones), and how the folder names and wraps them (``hub_layout.HubNaming``, for a
        vision-language folder: its wrapper's config.json, less what it does not carry)."""
        files = {self._stored.get(key, key): str(path.relative_to(self.folder)) for key, path, *_ in self.raw}
        files.update((info.name, info.where) for info in self.carried)
        layout = file_layout(files, (self.folder / INDEX_FILE).is_file())
        if any(info.dtype == requantize.UE8M0 for info in self.carried):
            layout[REQUANTIZED_KEY] = {key: config[key] for key in ("quantization_config", "expert_dtype")
                                       if key in config}
        if self.naming.wrapped:
            wrapper = hub_layout.wrapper_of(config)
            if wrapper is not None:
                wrapper = {"config": carried(wrapper["config"]), "text_keys": wrapper["text_keys"]}
            layout[hub_layout.NAMING_KEY] = dataclasses.replace(self.naming, wrapper=wrapper).to_json()
        elif not self.naming.plain:
            layout[hub_layout.NAMING_KEY] = self.naming.to_json()
        return layout

    def load_carried(self, name: str) -> torch.Tensor:
        return self.pages.copy_out(self._file(self._carried_files[name]).get_tensor(name))

    def _structured_info(self, name: str, found: list, shapes: dict) -> TensorInfo:
        """A packed tensor's slice, or per-expert tensors stacked: shape as titanctl holds it."""
        piece, key, path = found[0]
        shape, dtype = shapes[key]
        where = str(path.relative_to(self.folder))
        if piece.expert is None:
            if len(found) > 1:
                raise CheckpointError(f"{name} is packed in both {key!r} and {found[1][1]!r}")
            if shape[piece.dim] % piece.parts:
                raise CheckpointError(f"tensor {key!r} in {where} has shape {shape}: dim {piece.dim} does not split "
                                      f"into {piece.parts} equal parts")
            split = list(shape)
            split[piece.dim] //= piece.parts
            return TensorInfo(name, tuple(split), dtype, f"{key}[part {piece.index + 1} of {piece.parts}]", where)
        experts = sorted((p.expert, p.index) for p, _key, _path in found)
        if experts != [(e, i) for e in range(self.args.moe.num_experts) for i in range(piece.parts)]:
            each = "one" if piece.parts == 1 else f"{piece.parts} (of dim 0)"
            raise CheckpointError(f"{name}: the per-expert tensors ({key!r}, ...) are not {each} of each of "
                                  f"{self.args.moe.num_experts} experts")

        def kind(k: str) -> str:  # as loaded: an FP8 weight is dequantized
            loaded_shape, loaded = shapes[k]
            return f"{loaded_shape} {'float8 dequantized to ' if k in self.scales else ''}{dtype_name(loaded)}"

        for _p, other, _path in found:  # the fault named: a shape, or a dtype (e.g. one expert not FP8)
            if shapes[other] != (shape, dtype):
                raise CheckpointError(f"{name}: expert tensor {other!r} is {kind(other)}, but {key!r} is {kind(key)}: "
                                      "every expert's must have the same shape and dtype")
        return TensorInfo(name, (self.args.moe.num_experts, piece.parts * shape[0], *shape[1:]), dtype,
                          key.replace(f".{piece.expert}.", ".{e}.", 1), where)

    def _file(self, path: Path):
        if self._open_path != path:
            self._close_file()
            self._open_file = safe_open(str(path), framework="pt")
            self._open_path = path
            self.pages.track(path)
        return self._open_file

    def _close_file(self) -> None:
        if self._open_path is not None:
            self.pages.forget(self._open_path)
        self._open_file, self._open_path = None, None

    def load(self, name: str) -> torch.Tensor:
        info = self.info(name)
        if name in self._structured:
            return self._load_structured(self._structured[name])
        if info.where == "(not stored: zeros)":
            return torch.zeros(info.shape, dtype=info.dtype)
        if info.shown in self.scales:
            _, tensor = from_hf_tensor(info.shown, self._dequantized(info.shown, self.folder / info.where), self.args)
            return tensor  # a fresh tensor, permuted or not
        if info.shown in self.mxfp4:
            _, tensor = from_hf_tensor(info.shown, self._mxfp4_dequantized(self.mxfp4[info.shown]), self.args)
            return tensor.contiguous()  # transposed back: the fresh tensor in its own order
        view = self._tensor(self.folder / info.where, info.shown)  # memory-mapped
        _, tensor = from_hf_tensor(info.shown, view, self.args)
        if tensor.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
            tensor = self.pages.copy_out(tensor)  # not permuted (perhaps transposed): copy chunk by chunk
        else:
            self.pages.release(view)  # q/k: the permutation made the copy
        return mxfp4.check_finite(tensor, info.shown, self.folder / info.where) if self.mxfp4 else tensor

    def _dequantized(self, key: str, path: Path, out: torch.Tensor | None = None) -> torch.Tensor:
        """The FP8 weight `key` of `path` times its block scales, in ``dequantize_to`` (into `out`)."""
        scale_of = self.scales[key]
        # The scales first (small, copied): reading them may close the weight's file.
        scale = self.pages.copy_out(self._tensor(scale_of.path, scale_of.key)).float()
        view = self._tensor(path, key)  # memory-mapped
        if key in self.fp4:
            return fp4_experts.dequantize(view, scale, self.dequantize_to, out=out, release=self.pages.release)
        return dequantize(view, scale, self.block, self.dequantize_to, out=out, release=self.pages.release)

    def _mxfp4_dequantized(self, entry: mxfp4.Packed) -> torch.Tensor:
        """The matrix an MXFP4 pair encodes, in ``dequantize_to``, its last two dimensions swapped as
        transformers holds it (a view of the fresh tensor)."""
        # The scales first (small, copied): reading them may close the blocks' file.
        scales = self.pages.copy_out(self._tensor(entry.scales_path, entry.scales))
        blocks = self._tensor(entry.blocks_path, entry.blocks)  # memory-mapped
        return mxfp4.dequantize(blocks, scales, self.dequantize_to, entry.name, release=self.pages.release).mT

    def _load_structured(self, found: list) -> torch.Tensor:
        found = sorted(found, key=lambda f: (f[0].expert or 0, f[0].index))
        piece, key, path = found[0]
        if piece.expert is None:  # one slice of a packed tensor
            if key in self.scales:  # its blocks may straddle the slices: dequantize whole, keep the slice
                whole = self._dequantized(key, path)
                size = whole.shape[piece.dim] // piece.parts
                return whole.narrow(piece.dim, piece.index * size, size).clone()
            view = self._tensor(path, key)  # memory-mapped
            size = view.shape[piece.dim] // piece.parts
            part = view.narrow(piece.dim, piece.index * size, size)
            out = part.clone()
            self.pages.release(part)
            return out
        # One tensor per expert (or several, stacked on the matrix's dim 0): each written straight into
        # its rows of the stack (no second copy).
        info = self.info(piece.name)
        stack = torch.empty(info.shape, dtype=info.dtype)
        rows = [part for matrix in stack for part in matrix.chunk(piece.parts, dim=0)]
        for (_piece, key, path), row in zip(found, rows, strict=True):
            if key in self.scales:
                self._dequantized(key, path, out=row)
            else:
                self.pages.copy_into(row, self._tensor(path, key))
        return stack

    def close(self) -> None:
        self._close_file()


def file_layout(files: dict[str, str], index: bool) -> dict[str, Any]:
    """{HF name: file} kept small (a 671B model has some 90,000 tensors): the file names, the files of the
    sorted names as runs [file number, count], and a digest of those names (an export whose tensors are
    others does not use it)."""
    names = sorted(files)
    order = list(dict.fromkeys(files[name] for name in names))
    numbers = {file: number for number, file in enumerate(order)}
    runs: list[list[int]] = []
    for name in names:
        number = numbers[files[name]]
        if runs and runs[-1][0] == number:
            runs[-1][1] += 1
        else:
            runs.append([number, 1])
    return {"files": order, "runs": runs, "names_sha256": _names_digest(names), "index": index}


def files_of(layout: Any, names: list[str]) -> dict[str, str] | None:
    """{HF name: file} that ``layout`` (``file_layout``) records for exactly these tensor names, else None."""
    try:
        names = sorted(names)
        if layout["names_sha256"] != _names_digest(names) or sum(n for _, n in layout["runs"]) != len(names):
            return None
        assigned = [layout["files"][number] for number, count in layout["runs"] for _ in range(count)]
    except (KeyError, TypeError, IndexError, ValueError):
        return None  # not a layout titanctl wrote
    if not all(isinstance(f, str) and f.endswith(".safetensors") and "/" not in f for f in assigned):
        return None
    return dict(zip(names, assigned))


def _names_digest(names: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def write_order(names: list[str], args: ModelArgs, layout: dict[str, Any] | None = None,
                carried: list[str] = ()) -> list[str]:
    """The order in which ``write`` (given ``layout``) loads the tensors of a source whose infos name
    ``names`` and that carries the tensors ``carried`` (the ranks of a training run walk it together:
    ``titanctl.checkpoint.run.hf_save``): theirs, less the state the format does not store, file by file
    when the source's files are kept."""
    return _plan(names, lambda name: 0, args, layout, DEFAULT_MAX_SHARD_SIZE, {name: 0 for name in carried})[2]


def carried_written(source: Source, layout: dict[str, Any] | None, text_only: bool) -> list[TensorInfo]:
    """The carried tensors (``Source.carried``) an export writes: all of them, unless ``text_only`` or the
    layout records no wrapper config to write them under (``hub_layout.HubNaming.wrapper``) nor a published
    folder's naming; a release's UE8M0 block scales are written always (``requantize``)."""
    if text_only:
        return []
    naming = HubNaming.of_layout(layout)
    if naming.wrapper is not None or naming.prefix == hub_layout.UNPREFIXED:
        return source.carried
    return [info for info in source.carried if info.dtype == requantize.UE8M0]  # a release's block scales


# One Hugging Face tensor of a write: its name, the titanctl weights it is made of with each one's slice
# (dim, index, parts) or None (the whole tensor), and its bytes. A carried tensor is made of none.
Entry = tuple[str, list[tuple[str, "tuple[int, int, int] | None"]], int]


def _plan(names: list[str], nbytes_of: Callable[[str], int], args: ModelArgs, layout: dict[str, Any] | None,
          max_shard_size: int, carried: dict[str, int] | None = None,
          ) -> tuple[list[str], list[list[Entry]], list[str], bool]:
    """(file names, the entries each holds in order, the order in which to load titanctl's weights, whether
    an index is written): the source's files when ``layout`` records exactly these Hugging Face tensors
    (``carried``'s among them: {stored name: bytes}), else greedy shards of at most ``max_shard_size`` in
    the order of ``names``, then ``carried``. Names follow the layout's ``hub_layout.HubNaming``."""
    naming = HubNaming.of_layout(layout)
    entries: dict[str, Entry] = {}
    for name in names:
        stored = hub_names_of(name, args, naming)
        for hf_name, piece in stored:
            nbytes = nbytes_of(name) // len(stored)
            _, parts, total = entries.get(hf_name, (hf_name, [], 0))
            entries[hf_name] = (hf_name, [*parts, (name, piece)], total + nbytes)
    for hf_name, nbytes in (carried or {}).items():
        if hf_name in entries:
            raise CheckpointError(f"the carried tensor {hf_name!r} is also a tensor of the model")
        entries[hf_name] = (hf_name, [], nbytes)
    kept = files_of(layout, list(entries)) if layout else None
    if kept is not None:  # the source's files: each holds what it held, in the source's order of files
        files = list(dict.fromkeys(kept.values()))
        plan = [[entry for entry in entries.values() if kept[entry[0]] == file] for file in files]
        index_file = bool(layout.get("index"))
    else:
        plan, size = [[]], 0
        for entry in entries.values():
            if plan[-1] and size + entry[2] > max_shard_size:
                plan.append([])
                size = 0
            plan[-1].append(entry)
            size += entry[2]
        files = [SINGLE_FILE] if len(plan) == 1 else [shard_name(i, len(plan)) for i in range(1, len(plan) + 1)]
        index_file = len(plan) > 1
    order = list(dict.fromkeys(name for shard in plan for _, parts, _ in shard for name, _ in parts))
    return files, plan, order, index_file


def write(
    folder: Path,
    args: ModelArgs,
    source: Source,
    *,
    dtype: torch.dtype | None,
    progress: Progress,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    token_ids: tuple[int | None, int | None] | None = None,
    source_config: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    layout: dict[str, Any] | None = None,
    text_only: bool = False,
) -> None:
    """``token_ids``: (bos, eos) of the tokenizer exported beside the weights, for config.json.
    ``source_config``: the config.json the model came from (``hf.carried_config``), written back
    when it still describes the model; else config.json is written from ``args``. Tensors are
    loaded in ``write_order``, each once; its Hugging Face tensors (one per expert for routed
    experts) fill the shards in order, so no shard exceeds ``max_shard_size`` unless one tensor does.
    ``layout``: the source folder's files (``file_layout``), used when they hold exactly these tensors
    (and no --max-shard-size was asked for), and its names (``hub_layout.HubNaming``: a vision-language
    folder's prefix and packed experts, whose slices are joined here). The source's carried tensors
    (``Source.carried``: a vision-language folder's vision encoder and prediction head) are written as
    they are, under the wrapper's config.json (``carried_written``); ``text_only`` leaves them out."""
    if max_shard_size <= 0:
        raise CheckpointError(f"--max-shard-size must be positive, got {max_shard_size}")
    naming = HubNaming.of_layout(layout)
    infos = {info.name: info for info in source.infos}
    carried_infos = carried_written(source, layout, text_only)
    carried = {info.name: info.nbytes() for info in carried_infos}
    names, plan, _order, index_file = _plan(list(infos), lambda name: infos[name].nbytes(dtype), args, layout,
                                            max_shard_size, carried)
    # {HF weight: its carried UE8M0 scales}: such weights are written in their release's format
    scale_of = _block_scales_of([info.name for info in carried_infos if info.dtype == requantize.UE8M0])
    quantization = (layout or {}).get(REQUANTIZED_KEY) or {}
    block = declared_block_size(quantization, "the checkpoint's file layout") or DEFAULT_BLOCK
    saturated = 0
    weight_map: dict[str, str] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # titanctl weight -> its HF tensors not yet written
    for file, shard in zip(names, plan, strict=True):
        tensors = {}
        for hf_name, parts, nbytes in shard:
            if not parts:  # carried: as it is stored
                tensors[hf_name] = source.load_carried(hf_name)
                weight_map[hf_name] = file
                progress(hf_name, nbytes)
                continue
            pieces = []
            for name, piece in parts:
                if name not in pending:
                    pending[name] = to_hub_tensors(name, cast(source.load(name), dtype), args, naming)
                pieces.append((piece, pending[name].pop(hf_name)))
                if not pending[name]:
                    del pending[name]
            if pieces[0][0] is None:
                tensors[hf_name] = pieces[0][1].contiguous()
            else:  # the slices of a packed tensor, joined in their order
                pieces.sort(key=lambda p: p[0][1])
                tensors[hf_name] = torch.cat([t for _, t in pieces], dim=pieces[0][0][0])
            del pieces
            if hf_name in scale_of:
                written = requantize.against(tensors[hf_name], source.load_carried(scale_of[hf_name]), block)
                tensors[hf_name], saturated = written.tensor, saturated + written.saturated
            weight_map[hf_name] = file
            progress(hf_name, nbytes)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    # Of the tensors written: an expert bias Hugging Face does not store reads as float32 zeros.
    out_dtypes = sorted({dtype_name(written_dtype(i.dtype, dtype)) for i in source.infos
                         if hf_names_of(i.name, args) and i.dtype.is_floating_point})
    config = export_config(
        args, source_config, dtype=out_dtypes[0] if len(out_dtypes) == 1 else "float32", token_ids=token_ids,
        default_token_ids=special_token_ids(args), notes=notes,
    )
    if scale_of:  # the release's format again: its quantization keys
        config.update(quantization)
        if saturated and notes is not None:
            notes.append(f"{saturated} weight values beyond their format's largest at the carried block scale were "
                         "written as that largest (FP8 448, FP4 6 times the scale)")
    if carried and naming.wrapper is not None:  # the folder again: the wrapper around the text model
        config = naming.wrapped_config(config)
    elif (left := [info.name for info in source.carried if info.name not in carried]) and notes is not None:
        text = config.get("architectures", ["the *ForCausalLM"])[0]
        notes.append(hub_layout.left_out_note(left, text) if text_only and naming.wrapped else
                     f"{hub_layout.TEXT_ONLY_FLAG}: {len(left)} carried tensors left out (a release's block scales "
                     f"and its parts titanctl does not build); the export is the model alone ({text}), its weights "
                     "unquantized" if text_only else
                     f"{len(left)} carried tensors of a vision-language folder left out: the checkpoint "
                     f"records no wrapper config.json to write them under; the export is the text model ({text})")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    total = sum(n for shard in plan for *_, n in shard)
    # As save_pretrained writes it: the parameters (saved buffers such as an expert bias are not) and bytes.
    carried_values = sum(math.prod(info.shape) for info in source.carried if info.name in carried)
    metadata = {"total_parameters": num_params(args) + carried_values, "total_size": total}
    if index_file:
        index_data = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index_data, indent=2) + "\n")


def _block_scales_of(carried: list[str]) -> dict[str, str]:
    """{HF weight name: the carried scales it is written against} (``X.scale`` or ``X.weight_scale_inv`` of
    ``X.weight``), of the carried tensors an export writes."""
    pairs = {}
    for name in carried:
        if name.endswith(PUBLISHED_SCALE_SUFFIX):
            pairs[name.removesuffix(PUBLISHED_SCALE_SUFFIX) + ".weight"] = name
        elif name.endswith(SCALE_SUFFIX):
            pairs[name.removesuffix(SCALE_SUFFIX)] = name
    return pairs


def _layer_of(hf_name: str) -> int:
    """The layer a Hugging Face tensor belongs to (-1: none)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\..+", hf_name)
    return int(m.group(1)) if m else -1
