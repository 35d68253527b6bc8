"""DeepSeek-V4's hyper-parameters, named as transformers' ``DeepseekV4Config`` names them, with the
checks that refuse, in one line each, a schedule the model cannot build."""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """transformers' default schedule: two heavily compressed layers, then CSA and HCA alternating."""
    rest = tuple(CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0)))
    return ((HCA,) * min(n_layers, 2) + rest)[:n_layers]


@dataclass(frozen=True)
class CompressYarn:
    """YaRN on the compressed branches' RoPE (the published checkpoints: factor 16 over 65536 positions);
    its cos/sin factor is 1, as in DeepSeek's reference."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DeepseekV4Args:
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64  # the trailing channels of each head that RoPE rotates
    q_lora_rank: int = 1024
    o_groups: int = 8  # grouped output projection: head groups ...
    o_lora_rank: int = 1024  # ... each projected to this width before the mixing linear
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()  # empty: default_layer_types(n_layers)
    compress_rates: dict = field(default_factory=lambda: {CSA: 4, HCA: 128})
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0  # sliding-window layers
    compress_rope_theta: float = 160000.0  # CSA and HCA layers, their compressors and the indexer
    compress_yarn: CompressYarn | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_experts: int = 256
    top_k: int = 6
    moe_hidden_dim: int = 2048
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    mlp_layer_types: tuple[str, ...] = ()  # empty: the first 3 hash_moe, the rest moe
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    @property
    def attention_types(self) -> tuple[str, ...]:
        return self.layer_types or default_layer_types(self.n_layers)

    @property
    def mlp_types(self) -> tuple[str, ...]:
        return self.mlp_layer_types or tuple("hash_moe" if i < 3 else "moe" for i in range(self.n_layers))

    def check(self, seq_len: int | None = None) -> None:
        """Raise ValueError (one line) on a schedule or width the model cannot build."""
        for name, types, allowed in (("layer_types", self.attention_types, ATTENTION_TYPES),
                                     ("mlp_layer_types", self.mlp_types, MLP_TYPES)):
            if len(types) != self.n_layers:
                raise ValueError(f"{name} has {len(types)} entries for {self.n_layers} layers")
            bad = sorted(set(types) - set(allowed))
            if bad:
                raise ValueError(f"{name} has {bad}; valid: {', '.join(allowed)}")
        for kind in (CSA, HCA):
            rate = self.compress_rates.get(kind)
            if kind in self.attention_types and (not isinstance(rate, int) or rate < 1
                                                 or self.sliding_window % rate):
                raise ValueError(f"compress_rates[{kind!r}] is {rate!r}: it must be a positive divisor of "
                                 f"sliding_window {self.sliding_window}")
        if self.n_heads % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} does not divide n_heads {self.n_heads}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= self.head_dim:
            raise ValueError(f"rope_head_dim {self.rope_head_dim}: an even width up to head_dim {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is larger than num_experts {self.num_experts}")
        if seq_len is not None and CSA in self.attention_types:
            compressed = seq_len // self.compress_rates[CSA]
            if self.index_topk > compressed:
                raise ValueError(f"index_topk {self.index_topk} is larger than the compressed length {compressed} "
                                 f"(seq_len {seq_len} / compress rate {self.compress_rates[CSA]})")
