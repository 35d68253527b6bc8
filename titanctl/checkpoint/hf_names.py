"""Hugging Face ``*ForCausalLM`` <-> titanctl names, weights and config, for every family
(the names and config keys come from the family's spec).

Pure functions, no ``transformers`` import. Conversion is one tensor at a time
(``to_hf_tensor`` / ``from_hf_tensor``), so a converter can stream a 70B checkpoint
through it; ``iter_to_hf`` / ``iter_from_hf`` add the completeness checks over a
stream, and the ``*_state_dict`` functions are the same over a dict.

The one non-rename: Meta's RoPE rotates interleaved channel pairs ``(2i, 2i+1)`` of a
head, Hugging Face's rotates halves ``(i, i + head_dim/2)``. So for a model in Meta's layout
(Llama) the output rows of ``wq`` and ``wk`` are permuted within each head (``wk`` with the KV
head count). A tied output layer is the embedding table: Hugging Face writes only the embedding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from titanctl.checkpoint.model_args import check_args
from titanctl.checkpoint.shape_inference import kv_heads_hint
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs, spec_for_hf_model_type, spec_of
from titanctl.models.shapes import tied_weights, weight_shapes
from titanctl.models.spec import HFFormat

Pairs = Iterable[tuple[str, torch.Tensor]]  # (name, tensor), e.g. read one by one from safetensors

_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived buffers that old transformers versions saved; they carry no weights.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- names


def _hf_of(name: str, hf: HFFormat) -> str | None:
    if name in hf.top_names:
        return hf.top_names[name]
    m = _OURS_LAYER.fullmatch(name)
    return f"model.layers.{m.group(1)}.{hf.layer_names[m.group(2)]}" if m and m.group(2) in hf.layer_names else None


def _ours_of(hf_name: str, hf: HFFormat) -> str | None:
    for ours, theirs in hf.top_names.items():
        if theirs == hf_name:
            return ours
    m = _HF_LAYER.fullmatch(hf_name)
    if m:
        for ours, theirs in hf.layer_names.items():
            if theirs == m.group(2):
                return f"layers.{m.group(1)}.{ours}"
    return None


def _hf_name(name: str, args: ModelArgs) -> str:
    hf = _hf_of(name, spec_of(args).hf)
    if hf is None or name not in weight_shapes(args):
        raise CheckpointError(f"unknown titanctl tensor {name!r} (not a {args.family} weight of this model)")
    return hf


def _meta_name(name: str, args: ModelArgs) -> str:
    hf = spec_of(args).hf
    ours = _ours_of(name, hf)
    if ours is None or ours not in weight_shapes(args):
        raise CheckpointError(
            f"unknown Hugging Face tensor {name!r} (not a {hf.architecture} weight of this model)"
        )
    return ours


def canonical_name_of(hf_name: str) -> str | None:
    """The titanctl name of a Hugging Face weight name of any family, whatever the model's depth
    (None: no family's weight name)."""
    return next((ours for spec in all_specs() if (ours := _ours_of(hf_name, spec.hf)) is not None), None)


def _check_shape(meta_name: str, shown_name: str, tensor: torch.Tensor, args: ModelArgs) -> None:
    expected = weight_shapes(args)[meta_name]
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"tensor {shown_name!r} has shape {tuple(tensor.shape)}, expected {expected} for this model"
            f"{kv_heads_hint(meta_name, tuple(tensor.shape), expected, args)}"
        )


# ----------------------------------------------------------------------------- rotary permutation


def _heads_of(meta_name: str, args: ModelArgs) -> int | None:
    """Query or key heads whose rows to permute: only Meta's interleaved RoPE layout needs it."""
    if args.rope_layout != "interleaved":
        return None
    if meta_name.endswith("attention.wq.weight"):
        return args.n_heads
    if meta_name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: Meta's (pair, 2) order -> HF's (2, pair) order."""
    rows, cols = w.shape
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, pairs, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, 2, pairs, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- tensors


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One titanctl (Meta-named) weight -> its Hugging Face name and layout. Dtype is kept."""
    hf = _hf_name(name, args)
    _check_shape(name, name, tensor, args)
    heads = _heads_of(name, args)
    return hf, (tensor if heads is None else _interleaved_to_halves(tensor, heads))


def from_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One Hugging Face weight -> its titanctl (Meta) name and layout. Dtype is kept."""
    meta = _meta_name(name, args)
    _check_shape(meta, name, tensor, args)
    heads = _heads_of(meta, args)
    return meta, (tensor if heads is None else _halves_to_interleaved(tensor, heads))


def _convert_stream(pairs: Pairs, args: ModelArgs, to_hf: bool) -> Iterator[tuple[str, torch.Tensor]]:
    convert = to_hf_tensor if to_hf else from_hf_tensor
    aliases = tied_weights(args)  # a tied output layer is the embedding: Hugging Face stores it once
    missing = set(weight_shapes(args)) - set(aliases)  # titanctl names still to come
    for name, tensor in pairs:
        if not to_hf and name.endswith(_IGNORED_HF_SUFFIXES):
            continue
        if (name if to_hf else _meta_name(name, args)) in aliases:
            continue
        new_name, new_tensor = convert(name, tensor, args)
        meta = name if to_hf else new_name
        if meta not in missing:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        missing.discard(meta)
        yield new_name, new_tensor
    if missing:
        names = sorted(missing if to_hf else (_hf_name(m, args) for m in missing))
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(names[:3])}{more}")


def iter_to_hf(pairs: Pairs, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs to Hugging Face; raises at the end if a weight never came."""
    return _convert_stream(pairs, args, to_hf=True)


def iter_from_hf(pairs: Pairs, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream Hugging Face (name, tensor) pairs to titanctl; raises at the end if a weight never came."""
    return _convert_stream(pairs, args, to_hf=False)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return dict(iter_to_hf(sd.items(), args))


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every key ``load_state_dict`` wants, a tied alias included (as the embedding's tensor)."""
    out = dict(iter_from_hf(sd.items(), args))
    for alias, of in tied_weights(args).items():
        out[alias] = out[of]
    return out


# ----------------------------------------------------------------------------- config


def hf_config(
    args: ModelArgs,
    *,
    torch_dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json of the family's ``*ForCausalLM`` that transformers 4.x and 5.x both read."""
    config = spec_of(args).hf.config_from_args(args, max_position_embeddings)
    return {
        **config,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,  # 4.x name
        "dtype": torch_dtype,  # 5.x name
    }


def args_from_hf_config(
    cfg: dict[str, Any], *, max_seq_len: int | None = None, where: str = "the Hugging Face config"
) -> ModelArgs:
    """ModelArgs of a Hugging Face ``*ForCausalLM`` config (4.x or 5.x keys) of any family, whose
    ``model_type`` picks the family, checked (``titanctl.checkpoint.model_args.check_args``).

    ``max_seq_len`` (the RoPE table length; the trainer sets its own) defaults to
    ``max_position_embeddings``.
    """
    model_type = cfg.get("model_type", "llama")
    spec = spec_for_hf_model_type(model_type) if isinstance(model_type, str) else None
    if spec is None:
        known = ", ".join(s.hf.model_type for s in all_specs())
        raise CheckpointError(f"{where}: model_type {model_type!r} is no family titanctl builds ({known})")
    try:
        args = spec.hf.args_from_config(cfg, max_seq_len, where)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise CheckpointError(f"{where} has an invalid value: {e}") from None
    return check_args(args, where)


__all__ = [
    "args_from_hf_config",
    "canonical_name_of",
    "from_hf_state_dict",
    "from_hf_tensor",
    "hf_config",
    "iter_from_hf",
    "iter_to_hf",
    "to_hf_state_dict",
    "to_hf_tensor",
]
