from titanctl.config.job_config import Model as ModelConfig
from titanctl.errors import ConfigError
from titanctl.models.llama.args import LLAMA3_FLAVORS, ModelArgs
from titanctl.models.llama.model import Transformer
from titanctl.models.qwen3.args import QWEN3_FLAVORS

# Model family (config model.name) -> its flavors. Every family builds the same Transformer
# (titanctl.models.common.decoder); their flavors' ModelArgs switch what differs.
MODEL_FAMILIES = {"llama3": LLAMA3_FLAVORS, "qwen3": QWEN3_FLAVORS}


def model_args_from_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelArgs:
    """The flavor's published dimensions (with the recipe's depth and key/value heads when it sets
    them), the tokenizer's vocab and the run's sequence length."""
    flavors = MODEL_FAMILIES[cfg.name]
    args = flavors[cfg.flavor].replace(vocab_size=vocab_size, max_seq_len=seq_len, norm_type=cfg.norm_type)
    if cfg.n_layers:
        args = args.replace(n_layers=cfg.n_layers)
    if cfg.n_kv_heads:
        if args.n_heads % cfg.n_kv_heads:
            raise ConfigError(
                f"config key 'model.n_kv_heads' = {cfg.n_kv_heads} must divide flavor {cfg.flavor}'s "
                f"n_heads {args.n_heads}"
            )
        args = args.replace(n_kv_heads=cfg.n_kv_heads)
    return args


__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "model_args_from_config"]
