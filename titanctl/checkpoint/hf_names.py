"""Hugging Face ``LlamaForCausalLM`` <-> titanctl (Meta names), weights and config.

Pure functions, no ``transformers`` import. Conversion is one tensor at a time
(``to_hf_tensor`` / ``from_hf_tensor``), so a converter can stream a 70B checkpoint
through it; ``iter_to_hf`` / ``iter_from_hf`` add the completeness checks over a
stream, and the ``*_state_dict`` functions are the same over a dict.

The one non-rename: Meta's RoPE rotates interleaved channel pairs ``(2i, 2i+1)`` of a
head, Hugging Face's rotates halves ``(i, i + head_dim/2)``. So the output rows of
``wq`` and ``wk`` are permuted within each head (``wk`` with the KV head count).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from titanctl.checkpoint.model_args import check_args
from titanctl.checkpoint.shape_inference import kv_heads_hint
from titanctl.errors import CheckpointError
from titanctl.models.llama.args import ModelArgs, RopeScaling
from titanctl.models.llama.shapes import weight_shapes

Pairs = Iterable[tuple[str, torch.Tensor]]  # (name, tensor), e.g. read one by one from safetensors

# Per-layer suffixes: Meta name -> Hugging Face name.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES_INV = {hf: meta for meta, hf in _LAYER_NAMES.items()}
_TOP_NAMES_INV = {hf: meta for meta, hf in _TOP_NAMES.items()}
_META_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived buffers that old transformers versions saved; they carry no weights.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- names


def _hf_name(name: str, args: ModelArgs) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _META_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES and int(m.group(1)) < args.n_layers:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise CheckpointError(f"unknown titanctl tensor {name!r} (not a Llama weight of this model)")


def _meta_name(name: str, args: ModelArgs) -> str:
    if name in _TOP_NAMES_INV:
        return _TOP_NAMES_INV[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES_INV and int(m.group(1)) < args.n_layers:
        return f"layers.{m.group(1)}.{_LAYER_NAMES_INV[m.group(2)]}"
    raise CheckpointError(
        f"unknown Hugging Face tensor {name!r} (not a LlamaForCausalLM weight of this model)"
    )


def canonical_name_of(hf_name: str) -> str | None:
    """The titanctl (Meta) name of a Hugging Face Llama weight name, whatever the model's depth
    (None: not a Llama weight name)."""
    if hf_name in _TOP_NAMES_INV:
        return _TOP_NAMES_INV[hf_name]
    m = _HF_LAYER.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_NAMES_INV:
        return f"layers.{m.group(1)}.{_LAYER_NAMES_INV[m.group(2)]}"
    return None


def _check_shape(meta_name: str, shown_name: str, tensor: torch.Tensor, args: ModelArgs) -> None:
    expected = weight_shapes(args)[meta_name]
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"tensor {shown_name!r} has shape {tuple(tensor.shape)}, expected {expected} for this model"
            f"{kv_heads_hint(meta_name, tuple(tensor.shape), expected, args)}"
        )


# ----------------------------------------------------------------------------- rotary permutation


def _heads_of(meta_name: str, args: ModelArgs) -> int | None:
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
    missing = set(weight_shapes(args))  # Meta names still to come
    for name, tensor in pairs:
        if not to_hf and name.endswith(_IGNORED_HF_SUFFIXES):
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
    return dict(iter_from_hf(sd.items(), args))


# ----------------------------------------------------------------------------- config

_DEFAULT_THETA = 10000.0  # what transformers assumes when a config names no theta
_DEFAULT_EPS = 1e-6  # LlamaConfig's default rms_norm_eps


def hf_config(
    args: ModelArgs,
    *,
    torch_dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json for ``LlamaForCausalLM`` that transformers 4.x and 5.x both read.

    RoPE is written twice: 4.x's ``rope_theta`` + ``rope_scaling`` (which 5.x still reads,
    and prefers) and 5.x's ``rope_parameters`` (which 4.x ignores).
    ``max_position_embeddings`` defaults to ``max_seq_len``, and with Llama 3.1 scaling to
    at least 16 x the original context (Meta's published 131072 = 16 x 8192); it must
    exceed ``original_max_position_embeddings``.
    """
    scaling = args.rope_scaling
    if max_position_embeddings is None:
        max_position_embeddings = args.max_seq_len
        if scaling is not None:
            published = 16 * scaling.original_max_position_embeddings
            max_position_embeddings = max(max_position_embeddings, published)
    if scaling is not None and max_position_embeddings <= scaling.original_max_position_embeddings:
        raise CheckpointError(
            f"max_position_embeddings {max_position_embeddings} must exceed the RoPE scaling's "
            f"original_max_position_embeddings {scaling.original_max_position_embeddings}"
        )
    theta = float(args.rope_theta)
    if scaling is None:
        rope_scaling = None
        rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
        }
        rope_parameters = {**rope_scaling, "rope_theta": theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,  # 4.x name
        "dtype": torch_dtype,  # 5.x name
    }


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"Hugging Face config lacks {key!r}")
    return cfg[key]


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 prefers a 4.x `rope_scaling` over `rope_parameters` when both are present.
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    v5_theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    thetas = (params.get("rope_theta"), cfg.get("rope_theta"), v5_theta)
    theta = next((t for t in thetas if t is not None), _DEFAULT_THETA)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial rotary embeddings (partial_rotary_factor != 1) are not Llama 3")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise CheckpointError(f"unsupported RoPE type {rope_type!r} (titanctl knows 'default' and 'llama3')")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings, so do we.
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or _require(cfg, "max_position_embeddings")
            ),
        )
    except KeyError as e:
        raise CheckpointError(f"Hugging Face llama3 RoPE scaling lacks {e.args[0]!r}") from None
    return float(theta), scaling


def _ffn_args(dim: int, hidden: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which ModelArgs.ffn_hidden_dim == hidden."""
    if hidden <= 0:
        raise CheckpointError(f"intermediate_size must be positive, got {hidden}")
    base = int(2 * 4 * dim / 3)
    candidates: list[tuple[int, float | None]] = [
        (256, None),  # Llama defaults
        (1024, 1.3),  # 8B
        (4096, 1.3),  # 70B
        (4096, 1.2),  # 405B
        # Fallback, always exact: round up to `hidden` itself, after shrinking if needed.
        (hidden, None if base <= hidden else hidden / base),
    ]
    for multiple_of, multiplier in candidates:
        probe = ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if probe.ffn_hidden_dim == hidden:
            return multiple_of, multiplier
    raise CheckpointError(f"cannot express intermediate_size {hidden} for dim {dim} in ModelArgs")


def args_from_hf_config(
    cfg: dict[str, Any], *, max_seq_len: int | None = None, where: str = "the Hugging Face config"
) -> ModelArgs:
    """ModelArgs of a Hugging Face LlamaForCausalLM config (4.x or 5.x keys), checked
    (``titanctl.checkpoint.model_args.check_args``) before any arithmetic on them.

    ``max_seq_len`` (the RoPE table length; the trainer sets its own) defaults to
    ``max_position_embeddings``.
    """
    if cfg.get("model_type", "llama") != "llama":
        raise CheckpointError(f"not a Llama config: model_type {cfg.get('model_type')!r}")
    try:
        n_heads = _whole(_require(cfg, "num_attention_heads"))
        declared = ModelArgs(
            dim=_whole(_require(cfg, "hidden_size")),
            n_layers=_whole(_require(cfg, "num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=_whole(cfg.get("num_key_value_heads") or n_heads),
            vocab_size=_whole(_require(cfg, "vocab_size")),
            norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_EPS)),
            max_seq_len=_whole(max_seq_len or cfg.get("max_position_embeddings") or ModelArgs.max_seq_len),
        )
        check_args(declared, where)
        hidden = _whole(_require(cfg, "intermediate_size"))
        theta, scaling = _rope_from_hf(cfg)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise CheckpointError(f"{where} has an invalid value: {e}") from None
    dim = declared.dim
    if cfg.get("head_dim") not in (None, declared.head_dim):
        raise CheckpointError(
            f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads = {declared.head_dim}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {cfg['hidden_act']!r} is not Llama's 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise CheckpointError(f"{flag}=true: Llama 3 has no biases")
    if cfg.get("tie_word_embeddings"):
        raise CheckpointError(
            "tie_word_embeddings=true is not supported (Llama 3.1 has a separate output layer)"
        )
    multiple_of, multiplier = _ffn_args(dim, hidden)
    args = declared.replace(
        multiple_of=multiple_of, ffn_dim_multiplier=multiplier, rope_theta=theta, rope_scaling=scaling
    )
    return check_args(args, where)


def _whole(value: Any) -> int:
    """An integer field: ints (and integral floats, as some exporters write them) only."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


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
