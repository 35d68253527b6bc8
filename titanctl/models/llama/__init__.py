from titanctl.config.job_config import Model as ModelConfig
from titanctl.models.llama.args import LLAMA3_FLAVORS, ModelArgs
from titanctl.models.llama.model import Transformer


def model_args_from_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelArgs:
    """The flavor's published dimensions, with the tokenizer's vocab and the run's sequence length."""
    args = LLAMA3_FLAVORS[cfg.flavor].replace(vocab_size=vocab_size, max_seq_len=seq_len)
    if cfg.n_layers:
        args = args.replace(n_layers=cfg.n_layers)
    return args


__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "model_args_from_config"]
