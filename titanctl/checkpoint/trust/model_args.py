"""Model arguments that come from a checkpoint's own files, checked in one place.

``params.json`` (Meta), ``config.json`` (Hugging Face) and ``titanctl.json`` each give a
model's size. Whatever the file, its values pass :func:`check_args` (types, ranges, and the
divisibility the model relies on, so ``n_heads = 0`` is a one-line error, not a
ZeroDivisionError) and then :func:`check_declared` against the tensors the checkpoint
really holds (names and shapes from headers and indexes: nothing read yet, nothing sized by
the declared values allocated). Only then does anything build a model or a table of
expected shapes from them: a ``params.json`` declaring 10^7 layers or a dim of 10^9 is
refused before it can allocate anything.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import (
    EXPERT_KINDS,
    LAYER_TYPES,
    ROPE_LAYOUTS,
    SCORE_FUNCS,
    CompressedAttentionArgs,
    LinearAttentionArgs,
    MLAArgs,
    ModelArgs,
    MoEArgs,
    RopeScaling,
    YarnScaling,
)
from titanctl.models.common.norms import NORMS
from titanctl.models.registry import FAMILIES
from titanctl.models.shapes import num_params

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The final norm's weight, as each format names it: shape (dim,) in every format and every shard.
FINAL_NORMS = ("norm.weight", "model.norm.weight", "norm.scale")


# No size, count or length of a model is 2^31 or more (tensor dimensions are 32-bit in kernels).
MAX_SIZE = 2**31 - 1


def _int(value: Any, name: str, where: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {name} is {_brief(value)}, expected an integer >= {minimum}")
    if value > MAX_SIZE:
        raise CheckpointError(f"{where}: {name} is {_brief(value)}, expected at most {MAX_SIZE:,}")


def _positive(value: Any, name: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: {name} is {_brief(value)}, expected a finite number > 0")


def _one_of(value: Any, name: str, where: str, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if isinstance(value, bool) != isinstance(choices[0], bool) or value not in choices:
        valid = ", ".join(map(str, choices))
        raise CheckpointError(f"{where}: {name} is {_brief(value)}, expected one of {valid}")


def _brief(value: Any, limit: int = 60) -> str:
    """A value from a file, cut so that a 4,000-digit number makes no 4,000-character error line."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length():,} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def check_finite_numbers(data: Any, where: str) -> None:
    """Every number in a checkpoint's JSON (config.json, params.json, an index) finite. Python's
    ``json`` reads ``NaN``, ``Infinity`` and 1e999 (which no JSON standard allows) as floats, and a
    NaN rope_theta or norm eps gives a model that computes NaN; refused here, when the file is read,
    whichever key holds it and whichever command reads it."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:  # the nesting is bounded by the reader (safe_io.MAX_NESTING)
        item, at = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise CheckpointError(f"{where}: {_brief(at, 80) if at else 'the file'} is {item}: a config's numbers "
                                  "must be finite (JSON has no NaN or Infinity)")
        if isinstance(item, dict):
            stack.extend((value, f"{at}.{key}" if at else str(key)) for key, value in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((value, f"{at}[{i}]") for i, value in reversed(list(enumerate(item))))


def check_args(args: ModelArgs, where: str) -> ModelArgs:
    """`args` (read from `where`) if every value is one the model can be built with; a one-line
    CheckpointError naming the value otherwise."""
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
        _int(getattr(args, name), name, where)
    _int(args.mtp_layers, "mtp_layers", where, minimum=0)
    if args.n_kv_heads is not None:
        _int(args.n_kv_heads, "n_kv_heads", where)
    for name in ("norm_eps", "rope_theta"):
        _positive(getattr(args, name), name, where)
    if args.ffn_dim_multiplier is not None:
        _positive(args.ffn_dim_multiplier, "ffn_dim_multiplier", where)
    for name in ("explicit_head_dim", "explicit_ffn_hidden_dim"):  # set by families that publish them (Qwen3)
        if getattr(args, name) is not None:
            _int(getattr(args, name), name, where)
    for name in ("depth_init", "qk_norm", "tie_embeddings", "attention_bias", "attention_sinks",
                 "attention_output_gate", "norm_offset"):
        _one_of(getattr(args, name), name, where, (True, False))
    _check_sliding_window(args, where)
    _check_linear_attention(args, where)
    _one_of(args.family, "family", where, FAMILIES)
    _one_of(args.norm_type, "norm_type", where, NORMS)
    _one_of(args.rope_layout, "rope_layout", where, ROPE_LAYOUTS)
    if args.explicit_head_dim is None and args.dim % args.n_heads:
        raise CheckpointError(f"{where}: dim {args.dim} is not divisible by n_heads {args.n_heads}")
    if args.n_heads % args.kv_heads:
        raise CheckpointError(f"{where}: n_heads {args.n_heads} is not divisible by n_kv_heads {args.kv_heads}")
    if args.head_dim % 2:
        raise CheckpointError(
            f"{where}: head_dim = dim / n_heads = {args.head_dim} must be even (RoPE rotates pairs of channels)"
        )
    if args.ffn_hidden_dim < 1:
        raise CheckpointError(f"{where}: ffn_dim_multiplier {args.ffn_dim_multiplier} leaves no feed-forward width")
    moe = args.moe
    if moe is not None:
        if not isinstance(moe, MoEArgs):
            raise CheckpointError(f"{where}: moe is {_brief(moe)}, expected the Mixture-of-Experts settings")
        for name in ("num_experts", "top_k", "hidden_dim"):
            _int(getattr(moe, name), f"moe.{name}", where)
        _int(moe.num_shared_experts, "moe.num_shared_experts", where, minimum=0)
        _int(moe.first_dense_layers, "moe.first_dense_layers", where, minimum=0)
        _positive(moe.route_scale, "moe.route_scale", where)
        for name in ("n_group", "topk_group"):
            _int(getattr(moe, name), f"moe.{name}", where)
        if moe.n_group > 1 and (moe.num_experts % moe.n_group or moe.topk_group > moe.n_group
                                or moe.top_k > moe.topk_group * (moe.num_experts // moe.n_group)):
            raise CheckpointError(f"{where}: {moe.num_experts} experts in moe.n_group {moe.n_group} groups cannot "
                                  f"route moe.top_k {moe.top_k} from the moe.topk_group {moe.topk_group} best")
        _one_of(moe.score_func, "moe.score_func", where, SCORE_FUNCS)
        _one_of(moe.norm_topk_prob, "moe.norm_topk_prob", where, (True, False))
        _one_of(moe.router_bias, "moe.router_bias", where, (True, False))
        _one_of(moe.expert_kind, "moe.expert_kind", where, EXPERT_KINDS)
        for name in ("swiglu_limit", "swiglu_alpha"):
            _positive(getattr(moe, name), f"moe.{name}", where)
        if moe.top_k > moe.num_experts:
            raise CheckpointError(f"{where}: moe.top_k {moe.top_k} exceeds moe.num_experts {moe.num_experts}")
    _check_mla(args, where)
    scaling = args.rope_scaling
    if scaling is not None:
        if not isinstance(scaling, RopeScaling):
            raise CheckpointError(f"{where}: rope_scaling is {scaling!r}, expected Llama 3.1's four factors")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive(getattr(scaling, name), f"rope_scaling.{name}", where)
        _int(scaling.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings", where)
        if scaling.low_freq_factor == scaling.high_freq_factor:
            raise CheckpointError(f"{where}: rope_scaling low_freq_factor and high_freq_factor must differ")
    return args


def _check_sliding_window(args: ModelArgs, where: str) -> None:
    """gpt-oss's layer kinds: a tuple of LAYER_TYPES, and a window of >= 1 positions when any layer slides."""
    if not isinstance(args.layer_types, tuple) or not all(t in LAYER_TYPES for t in args.layer_types):
        raise CheckpointError(f"{where}: layer_types is {_brief(args.layer_types)}, expected a list of "
                              f"{', '.join(LAYER_TYPES)}")
    _int(args.sliding_window, "sliding_window", where, minimum=0)
    if "sliding_attention" in args.layer_types and args.sliding_window < 1:
        raise CheckpointError(f"{where}: sliding_window is {args.sliding_window}, but layer_types has sliding layers")


def _check_linear_attention(args: ModelArgs, where: str) -> None:
    """Gated DeltaNet layers (hybrid families): positive widths, heads that divide, a schedule of one
    entry per layer, partial RoPE within the head."""
    _int(args.partial_rope_dim, "partial_rope_dim", where, minimum=0)
    if args.partial_rope_dim > args.head_dim or args.partial_rope_dim % 2:
        raise CheckpointError(f"{where}: partial_rope_dim {args.partial_rope_dim} must be even and at most head_dim "
                              f"{args.head_dim}")
    la = args.linear_attention
    if la is None:
        if "linear_attention" in args.layer_types:
            raise CheckpointError(f"{where}: layer_types has linear_attention layers, but linear_attention is null")
        return
    if not isinstance(la, LinearAttentionArgs):
        raise CheckpointError(f"{where}: linear_attention is {_brief(la)}, expected LinearAttentionArgs")
    for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
        _int(getattr(la, name), f"linear_attention.{name}", where, minimum=1)
    if la.num_value_heads % la.num_key_heads:
        raise CheckpointError(f"{where}: linear_attention.num_key_heads {la.num_key_heads} must divide "
                              f"num_value_heads {la.num_value_heads}")
    if len(args.layer_types) != args.n_layers:
        raise CheckpointError(f"{where}: layer_types has {len(args.layer_types)} entries for {args.n_layers} layers")


def _check_mla(args: ModelArgs, where: str) -> None:
    """Multi-head Latent Attention and YaRN (DeepSeek-V3), when the args have them."""
    if args.mla is not None:
        if not isinstance(args.mla, MLAArgs):
            raise CheckpointError(f"{where}: mla is {_brief(args.mla)}, expected the latent attention's widths")
        _int(args.mla.q_lora_rank, "mla.q_lora_rank", where, minimum=0)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _int(getattr(args.mla, name), f"mla.{name}", where)
        if args.mla.qk_rope_head_dim % 2:
            raise CheckpointError(f"{where}: mla.qk_rope_head_dim {args.mla.qk_rope_head_dim} must be even "
                                  "(RoPE rotates pairs of channels)")
    if args.yarn is not None:
        if not isinstance(args.yarn, YarnScaling):
            raise CheckpointError(f"{where}: yarn is {_brief(args.yarn)}, expected YaRN's factors")
        if args.rope_scaling is not None:
            raise CheckpointError(f"{where}: yarn and rope_scaling both set: a model has one RoPE scaling")
        for name in ("factor", "beta_fast", "beta_slow"):
            _positive(getattr(args.yarn, name), f"yarn.{name}", where)
        _int(args.yarn.original_max_position_embeddings, "yarn.original_max_position_embeddings", where)
        for name in ("mscale", "mscale_all_dim"):  # 0: not given
            if getattr(args.yarn, name) != 0:
                _positive(getattr(args.yarn, name), f"yarn.{name}", where)
        _one_of(args.yarn.truncate, "yarn.truncate", where, (True, False))


def args_from_fields(raw: Any, where: str) -> ModelArgs:
    """ModelArgs from a dict of its fields (titanctl.json's ``model_args``), checked."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: model_args is {type(raw).__name__}, expected an object of ModelArgs fields")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(raw) - known)
    if unknown:
        valid = ", ".join(sorted(known))
        raise CheckpointError(f"{where}: model_args has unknown field {unknown[0]!r}; valid: {valid}")
    raw = dict(raw)
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        fields = {f.name for f in dataclasses.fields(RopeScaling)}
        if not isinstance(scaling, dict) or set(scaling) - fields:
            valid = ", ".join(sorted(fields))
            raise CheckpointError(f"{where}: model_args.rope_scaling must be an object with {valid}")
        raw["rope_scaling"] = RopeScaling(**scaling)
    moe = raw.get("moe")
    if moe is not None:
        fields = {f.name for f in dataclasses.fields(MoEArgs)}
        if not isinstance(moe, dict) or set(moe) - fields or not {"num_experts", "top_k", "hidden_dim"} <= set(moe):
            raise CheckpointError(f"{where}: model_args.moe must be an object with {', '.join(sorted(fields))}")
        raw["moe"] = MoEArgs(**moe)
    # DeepSeek-V3's MLA (and gpt-oss's YaRN), the hybrid families' Gated DeltaNet
    for key, cls in (("mla", MLAArgs), ("yarn", YarnScaling), ("linear_attention", LinearAttentionArgs),
                     ("compressed_attention", CompressedAttentionArgs)):
        if raw.get(key) is not None:
            fields = {f.name for f in dataclasses.fields(cls)}
            # YaRN's truncate came later: a titanctl.json without it meant true, the default.
            optional = {"truncate"} if cls is YarnScaling else set()
            if not isinstance(raw[key], dict) or not fields - optional <= set(raw[key]) <= fields:
                raise CheckpointError(f"{where}: model_args.{key} must be an object with {', '.join(sorted(fields))}")
            raw[key] = cls(**raw[key])
            if key == "compressed_attention" and isinstance(raw[key].compress_yarn, list):
                raw[key] = dataclasses.replace(raw[key], compress_yarn=tuple(raw[key].compress_yarn))
    if isinstance(raw.get("layer_types"), list):  # JSON has no tuples; ModelArgs is hashed
        raw["layer_types"] = tuple(raw["layer_types"])
    return check_args(ModelArgs(**raw), where)


def check_declared(
    args: ModelArgs, stored: Iterable[tuple[str, tuple[int, ...]]], vocab_size: int | None, where: str
) -> None:
    """The model `where` declares against the (name, shape) pairs the checkpoint stores, in any
    format's names (every shard's, for a sharded format): no more layers (prediction depths included)
    than it has, the dim of its final norm, the vocabulary of its embedding, and at most twice as many
    parameters as it stores values (an ``intermediate_size`` of 10^9 over tensors 768 wide; a few
    missing tensors are left for the format's completeness check to name). Cheap and bounded by the
    files, so it runs before anything sized by `args` is allocated."""
    layers: set[int] = set()
    norm: tuple[int, ...] | None = None
    values = 0
    for name, shape in stored:
        values += math.prod(shape)
        match = _LAYER.search(name)
        if match:
            layers.add(int(match.group(1)))
        elif name in FINAL_NORMS:
            norm = tuple(shape)
    if args.n_layers > len(layers):
        raise CheckpointError(
            f"{where} declares n_layers {args.n_layers}, but the checkpoint holds tensors of {len(layers)} layer(s)"
        )
    if args.n_layers + args.mtp_layers > len(layers):  # each prediction depth is one more layer's tensors
        raise CheckpointError(
            f"{where} declares {args.mtp_layers:,} multi-token-prediction depth(s) after its {args.n_layers} layers "
            f"(DeepSeek-V3's num_nextn_predict_layers), but the checkpoint holds tensors of {len(layers)} layer(s)"
        )
    if norm is not None and norm != (args.dim,):
        raise CheckpointError(f"{where} declares dim {args.dim}, but the checkpoint's final norm has shape {norm}")
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise CheckpointError(
            f"{where} declares vocab_size {args.vocab_size}, but the checkpoint's embedding has {vocab_size} rows"
        )
    declared = num_params(args)  # a meta-device model, its depth now bounded by the files
    if declared > 2 * values:
        raise CheckpointError(
            f"{where} declares a model of {declared:,} parameters (dim {args.dim}, ffn width "
            f"{args.ffn_hidden_dim:,}, {args.n_layers} layers, vocab {args.vocab_size:,}), but the checkpoint "
            f"stores {values:,} values"
        )
