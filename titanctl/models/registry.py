"""``model.name`` -> the family's ``ModelSpec``: the only door from the rest of titanctl into a family.

Families are imported on first use, so `titanctl --help` loads none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from torch import nn

from titanctl.config.job_config import Model as ModelConfig
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.spec import ModelSpec

# model.name -> the module that defines SPEC. Add a family here (and to config's model.name choices).
FAMILIES = {
    "llama3": "titanctl.models.llama.spec",
    "qwen3": "titanctl.models.qwen3.spec",
    "qwen3_moe": "titanctl.models.qwen3_moe.spec",
    "deepseek_v3": "titanctl.models.deepseek_v3.spec",
    "gpt_oss": "titanctl.models.gpt_oss.spec",
    "qwen3_5": "titanctl.models.qwen3_5.spec",
    "qwen3_5_moe": "titanctl.models.qwen3_5_moe.spec",
    "qwen3_next": "titanctl.models.qwen3_next.spec",
    "deepseek_v4": "titanctl.models.deepseek_v4.spec",
}


@functools.cache
def get_spec(name: str) -> ModelSpec:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    spec = importlib.import_module(FAMILIES[name]).SPEC
    assert spec.name == name, f"{FAMILIES[name]} declares family {spec.name!r}, registered as {name!r}"
    return spec


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in FAMILIES]


def flavor_args(name: str) -> ModelArgs:
    """A flavor by name: ``8B`` (Llama 3), or ``family:flavor`` (``qwen3:8B``) for any family."""
    family, _, flavor = name.rpartition(":")
    spec = get_spec(family or "llama3")
    if flavor not in spec.flavors:
        raise ConfigError(f"unknown {spec.name} flavor {flavor!r}; valid: {', '.join(spec.flavors)}")
    return spec.flavors[flavor]


def spec_of(args: ModelArgs) -> ModelSpec:
    """The spec of the family a ModelArgs builds."""
    return get_spec(args.family)


def build_model(args: ModelArgs) -> nn.Module:
    """The family's module for ``args``, on the current default device (use ``torch.device("meta")``)."""
    return spec_of(args).build(args)


def spec_for_hf_model_type(model_type: str) -> ModelSpec | None:
    """The family whose Hugging Face config.json says ``model_type`` (None: no such family)."""
    return next((spec for spec in all_specs() if spec.hf.model_type == model_type), None)


def model_args_from_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelArgs:
    """The recipe's family and flavor with its published dimensions (and the recipe's depth and
    key/value heads when it sets them), the tokenizer's vocab (or the flavor's published one, when
    larger) and the run's sequence length."""
    spec = get_spec(cfg.name)
    if cfg.flavor not in spec.flavors:
        raise ConfigError(
            f"config key 'model.flavor' = {cfg.flavor!r} is not a {cfg.name} flavor; choose one of "
            f"{', '.join(spec.flavors)}"
        )
    flavor = spec.flavors[cfg.flavor]
    # A flavor that publishes its embedding rows (Qwen3's, beyond its tokenizer's ids) keeps them.
    vocab_size = max(vocab_size, flavor.vocab_size)
    args = flavor.replace(vocab_size=vocab_size, max_seq_len=seq_len, norm_type=cfg.norm_type)
    if cfg.n_layers:
        args = args.replace(n_layers=cfg.n_layers)
        if args.linear_attention is not None:  # a hybrid schedule lists every layer: it follows the new depth
            types = args.layer_types
            args = args.replace(layer_types=tuple(types[i % len(types)] for i in range(cfg.n_layers)))
    if cfg.mtp_layers:
        if args.family not in ("deepseek_v3", "deepseek_v4"):
            raise ConfigError(
                f"config key 'model.mtp_layers' = {cfg.mtp_layers} needs model.name = 'deepseek_v3' or "
                f"'deepseek_v4' (multi-token prediction is DeepSeek's), not {cfg.name!r}; set it to 0"
            )
        args = args.replace(mtp_layers=cfg.mtp_layers)
    if cfg.n_kv_heads:
        if args.n_heads % cfg.n_kv_heads:
            raise ConfigError(
                f"config key 'model.n_kv_heads' = {cfg.n_kv_heads} must divide flavor {cfg.flavor}'s "
                f"n_heads {args.n_heads}"
            )
        args = args.replace(n_kv_heads=cfg.n_kv_heads)
    spec.check_run(args)
    return args


def with_training_keys(args: ModelArgs, cfg: ModelConfig) -> ModelArgs:
    """The model keys only training reads (model.indexer_loss_coeff, indexer_warmup_steps) into the args of a
    model with a lightning indexer; refused in one line for a model without one."""
    if not (cfg.indexer_loss_coeff or cfg.indexer_warmup_steps):
        return args
    if args.compressed_attention is None or "compressed_sparse_attention" not in args.layer_types:
        key = "indexer_loss_coeff" if cfg.indexer_loss_coeff else "indexer_warmup_steps"
        raise ConfigError(f"config key 'model.{key}' = {getattr(cfg, key)} needs a model with a lightning indexer "
                          f"(compressed sparse attention layers), not {cfg.name!r} flavor {cfg.flavor}; set it to 0")
    if cfg.indexer_warmup_steps and not cfg.indexer_loss_coeff:
        raise ConfigError(f"config key 'model.indexer_warmup_steps' = {cfg.indexer_warmup_steps} needs "
                          "model.indexer_loss_coeff > 0: the warm-up trains the indexer alone, by that loss")
    ca = dataclasses.replace(args.compressed_attention, indexer_loss_coeff=cfg.indexer_loss_coeff,
                             indexer_warmup_steps=cfg.indexer_warmup_steps)
    return args.replace(compressed_attention=ca)
