"""Hugging Face ``config.json`` keys that the decoder families share, and one reader of their values.

The dense families are the same ``*ForCausalLM`` layout in transformers; each family's ``hf`` module
adds its own keys. Pure functions, no ``transformers`` import.
"""

from __future__ import annotations

import math
from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, RopeScaling, YarnScaling

# Per-layer suffixes: titanctl name -> Hugging Face name (under model.layers.{i}.).
DECODER_LAYER_NAMES = {
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
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
DECODER_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

DEFAULT_THETA = 10000.0  # what transformers assumes when a config names no theta
# transformers' rope_type of the frequency-dependent scaling (RopeScaling): a name in Hugging Face's format.
SCALED_ROPE_TYPE = "llama3"
DEFAULT_EPS = 1e-6  # the default rms_norm_eps of transformers' dense decoder configs


_REQUIRED = object()


class ConfigJson:
    """A Hugging Face ``config.json`` read key by key with each value's type checked: the one reader of
    its numbers, booleans and lists for every family. A value of the wrong JSON type (``"1e-6"`` for
    ``rms_norm_eps``, ``"false"`` for ``tie_word_embeddings``, ``"256"`` for ``hidden_size``), out of
    range, or a list of the wrong length is a one-line CheckpointError naming the key; a missing or null
    key takes its default (``transformers``' own), a missing required one is refused."""

    def __init__(self, cfg: dict[str, Any], where: str, prefix: str = "") -> None:
        self.cfg, self.where, self.prefix = cfg, where, prefix

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value (for keys compared to a few known values)."""
        value = self.cfg.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def _value(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where}: Hugging Face config lacks {self.prefix + key!r}")
            return default
        return value

    def _bad(self, key: str, value: Any, expected: str) -> CheckpointError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
        kind = " (a string)" if isinstance(value, str) else ""
        return CheckpointError(f"{self.where}: {self.prefix}{key} is {shown}{kind}, expected {expected}")

    def integer(self, key: str, default: Any = _REQUIRED, *, minimum: int | None = None) -> Any:
        """An integer (an integral float, as some exporters write them, too)."""
        value = self._value(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value) or (minimum is not None and value < minimum):
            raise self._bad(key, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED, *, above: float | None = None,
               minimum: float | None = None) -> Any:
        value = self._value(key, default)
        if value is default:
            return value if value is None else float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (above is not None and value <= above) or (minimum is not None and value < minimum):
            bound = f" > {above:g}" if above is not None else f" >= {minimum:g}" if minimum is not None else ""
            raise self._bad(key, value, f"a finite number{bound}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is not default and not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def strings(self, key: str, *, length: int, choices: tuple[str, ...]) -> list[str] | None:
        """A list of ``length`` strings, each one of ``choices`` (e.g. ``layer_types``), or None."""
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != length or not all(v in choices for v in value):
            raise self._bad(key, value, f"a list of {length} of {', '.join(choices)} (one per layer)")
        return value

    def section(self, *keys: str) -> ConfigJson:
        """The first of ``keys`` that holds an object (``rope_scaling``, then ``rope_parameters``), as a
        reader of its own; an empty one when none does."""
        for key in keys:
            value = self.cfg.get(key)
            if value is not None and not isinstance(value, dict):
                raise self._bad(key, value, "an object")
            if value:
                return ConfigJson(value, self.where, f"{self.prefix}{key}.")
        return ConfigJson({}, self.where, f"{self.prefix}{keys[0]}.")


def decoder_args(cfg: ConfigJson, family: str, max_seq_len: int | None, eps: float = DEFAULT_EPS) -> ModelArgs:
    """The fields every dense decoder's config.json has, as ModelArgs of ``family``; the counts a
    reader divides by are checked to be positive first."""
    n_heads = cfg.integer("num_attention_heads", minimum=1)
    return ModelArgs(
        family=family,
        dim=cfg.integer("hidden_size", minimum=1),
        n_layers=cfg.integer("num_hidden_layers", minimum=1),
        n_heads=n_heads,
        n_kv_heads=cfg.integer("num_key_value_heads", 0, minimum=0) or n_heads,
        vocab_size=cfg.integer("vocab_size", minimum=1),
        norm_eps=cfg.number("rms_norm_eps", eps, above=0),
        max_seq_len=max_seq_len or cfg.integer("max_position_embeddings", 0, minimum=0) or ModelArgs.max_seq_len,
        tie_embeddings=cfg.flag("tie_word_embeddings", False),
    )


def check_plain_decoder(cfg: ConfigJson, what: str) -> None:
    """Refuse what the shared decoder does not build: other activations, biases."""
    if cfg.text("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{cfg.where}: hidden_act {cfg.get('hidden_act')!r} is not {what}'s 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.flag(flag, False):
            raise CheckpointError(f"{cfg.where}: {flag}=true: {what} has no biases")


def _theta(cfg: ConfigJson, params: ConfigJson, default: float) -> float:
    """RoPE's theta: in the scaling's own keys, the top level (4.x) or rope_parameters (5.x)."""
    for reader in (params, cfg, cfg.section("rope_parameters")):
        if reader.has("rope_theta"):
            return reader.number("rope_theta", above=0)
    return default


def _check_full_rotary(cfg: ConfigJson, params: ConfigJson, what: str) -> None:
    for reader in (params, cfg):
        if reader.has("partial_rotary_factor"):
            if reader.number("partial_rotary_factor") != 1.0:
                raise CheckpointError(f"{cfg.where}: partial rotary embeddings (partial_rotary_factor != 1) are not "
                                      f"{what}")
            return


def rope_from_hf(cfg: ConfigJson, what: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and frequency-dependent scaling (``RopeScaling``) from 4.x keys (rope_theta, rope_scaling)
    or 5.x's rope_parameters."""
    # transformers 5 prefers a 4.x `rope_scaling` over `rope_parameters` when both are present.
    params = cfg.section("rope_scaling", "rope_parameters")
    theta = _theta(cfg, params, DEFAULT_THETA)
    _check_full_rotary(cfg, params, what)
    rope_type = params.text("rope_type", params.text("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != SCALED_ROPE_TYPE:
        raise CheckpointError(f"{cfg.where}: unsupported RoPE type {rope_type!r} (titanctl knows 'default' and "
                              f"{SCALED_ROPE_TYPE!r})")
    low, high = params.number("low_freq_factor", above=0), params.number("high_freq_factor", above=0)
    if high <= low:  # the ramp between them divides by their difference
        raise CheckpointError(f"{cfg.where}: {params.prefix}high_freq_factor {high:g} must exceed low_freq_factor "
                              f"{low:g}")
    scaling = RopeScaling(
        factor=params.number("factor", minimum=1),
        low_freq_factor=low,
        high_freq_factor=high,
        # transformers falls back to max_position_embeddings, so do we.
        original_max_position_embeddings=params.integer("original_max_position_embeddings", 0, minimum=0)
        or cfg.integer("max_position_embeddings", minimum=1),
    )
    return theta, scaling


def decoder_config(args: ModelArgs, max_position_embeddings: int) -> dict[str, Any]:
    """config.json keys every dense decoder writes. RoPE is written twice: 4.x's ``rope_theta`` +
    ``rope_scaling`` (which 5.x still reads, and prefers) and 5.x's ``rope_parameters``."""
    scaling = args.rope_scaling
    theta = float(args.rope_theta)
    if scaling is None:
        rope_scaling = None
        rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        rope_scaling = {
            "rope_type": SCALED_ROPE_TYPE,
            "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
        }
        rope_parameters = {**rope_scaling, "rope_theta": theta}
    return {
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
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def yarn_from_config(cfg: ConfigJson, family: str, default_theta: float, *, takes_mscale: bool,
                     takes_truncate: bool) -> tuple[float, YarnScaling | None]:
    """RoPE theta and YaRN (or none) from 4.x keys (rope_theta, rope_scaling) or 5.x's rope_parameters,
    for a family whose YaRN takes the mscale terms (``takes_mscale``) or transformers' ``truncate``
    (``takes_truncate``: whole pairs at the ramp's ends or not); what the family's YaRN lacks is refused."""
    where = cfg.where
    # transformers 5 prefers a 4.x `rope_scaling` over `rope_parameters` when both are present.
    params = cfg.section("rope_scaling", "rope_parameters")
    theta = _theta(cfg, params, default_theta)
    _check_full_rotary(cfg, params, family)
    rope_type = params.text("rope_type", params.text("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"{where}: unsupported RoPE type {rope_type!r} for {family} ('default' or 'yarn')")
    if params.has("attention_factor"):
        raise CheckpointError(f"{where}: YaRN with attention_factor is not {family}'s")
    mscale, mscale_all_dim = params.number("mscale", 0.0, minimum=0), params.number("mscale_all_dim", 0.0, minimum=0)
    if not takes_mscale and (mscale or mscale_all_dim):
        raise CheckpointError(f"{where}: YaRN with mscale or mscale_all_dim is not {family}'s")
    truncate = params.flag("truncate", True)
    if not takes_truncate and not truncate:
        raise CheckpointError(f"{where}: YaRN with truncate=false is not {family}'s")
    return theta, YarnScaling(
        # YaRN stretches the context by factor (>= 1; 0 divided by zero, and below 1 it shrinks the context)
        factor=params.number("factor", minimum=1),
        # transformers falls back to max_position_embeddings, so do we.
        original_max_position_embeddings=params.integer("original_max_position_embeddings", 0, minimum=0)
        or cfg.integer("max_position_embeddings", minimum=1),
        beta_fast=params.number("beta_fast", 0.0, minimum=0) or 32.0,  # transformers' defaults, also for 0
        beta_slow=params.number("beta_slow", 0.0, minimum=0) or 1.0,
        mscale=mscale,  # 0: not given
        mscale_all_dim=mscale_all_dim,
        truncate=truncate,
    )
