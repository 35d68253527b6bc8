"""DeepSeek-V4's hyper-parameters: the model's own view (``DeepseekV4Args``, close to transformers'
``DeepseekV4Config``) read from titanctl's ModelArgs, the checks that refuse in one line each a schedule the
model cannot build, and the flavors."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanctl.models.common.args import CompressedAttentionArgs, ModelArgs, MoEArgs

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
    indexer_loss_coeff: float = 0.0  # the indexer's KL loss weight (indexer_loss.py); 0: off
    indexer_warmup_steps: int = 0  # the first steps attend densely and train the indexer alone
    num_experts: int = 256
    top_k: int = 6
    moe_hidden_dim: int = 2048
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    mlp_layer_types: tuple[str, ...] = ()  # empty: the first 3 hash_moe, the rest moe
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    mtp_layers: int = 0  # multi-token prediction depths (mtp.py), their blocks after the n_layers main ones

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


def v4_args(args: ModelArgs) -> DeepseekV4Args:
    """The model's view of titanctl's ModelArgs (which a checkpoint's titanctl.json records)."""
    ca, moe = args.compressed_attention, args.moe
    if ca is None or moe is None:
        raise ValueError(f"ModelArgs of family {args.family!r} need compressed_attention and moe")
    yarn = None if ca.compress_yarn is None else CompressYarn(*ca.compress_yarn)
    return DeepseekV4Args(
        vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        head_dim=args.head_dim, rope_head_dim=args.rope_dim, q_lora_rank=ca.q_lora_rank, o_groups=ca.o_groups,
        o_lora_rank=ca.o_lora_rank, sliding_window=args.sliding_window, layer_types=args.layer_types,
        compress_rates={CSA: ca.csa_rate, HCA: ca.hca_rate}, index_n_heads=ca.index_n_heads,
        index_head_dim=ca.index_head_dim, index_topk=ca.index_topk, rope_theta=args.rope_theta,
        compress_rope_theta=ca.compress_rope_theta, compress_yarn=yarn, hc_mult=ca.hc_mult,
        hc_sinkhorn_iters=ca.hc_sinkhorn_iters, hc_eps=ca.hc_eps, indexer_loss_coeff=ca.indexer_loss_coeff,
        indexer_warmup_steps=ca.indexer_warmup_steps, num_experts=moe.num_experts, top_k=moe.top_k,
        moe_hidden_dim=moe.hidden_dim, route_scale=moe.route_scale, swiglu_limit=moe.swiglu_limit,
        mlp_layer_types=tuple("hash_moe" if i < ca.hash_layers else "moe" for i in range(args.n_layers)),
        norm_eps=args.norm_eps, tie_embeddings=args.tie_embeddings, mtp_layers=args.mtp_layers)


def deepseek_v4_args(dim: int, n_layers: int, n_heads: int, head_dim: int, rope_dim: int, window: int,
                     attention: CompressedAttentionArgs, moe: MoEArgs, vocab_size: int,
                     layer_types: tuple[str, ...] = ()) -> ModelArgs:
    return ModelArgs(
        family="deepseek_v4", vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=1,
        explicit_head_dim=head_dim, partial_rope_dim=rope_dim, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, rope_layout="interleaved", sliding_window=window, attention_sinks=True,
        layer_types=layer_types or default_layer_types(n_layers), compressed_attention=attention, moe=moe)


def v4_moe(num_experts: int, top_k: int, hidden_dim: int, route_scale: float = 1.5) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="sqrtsoftplus",
                   route_scale=route_scale, num_shared_experts=1, expert_kind="clamped_silu", swiglu_limit=10.0)


DEEPSEEK_V4_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized: every attention kind (HCA, CSA, sliding, CSA), the first layer hash-routed; at seq_len 256 a
    # CSA layer has 64 compressed entries of which the indexer keeps 16, an HCA layer 16.
    "debugmodel": deepseek_v4_args(
        dim=128, n_layers=4, n_heads=4, head_dim=64, rope_dim=16, window=32, vocab_size=-1,
        layer_types=(HCA, CSA, SLIDING, CSA),
        attention=CompressedAttentionArgs(q_lora_rank=64, o_groups=2, o_lora_rank=64, csa_rate=4, hca_rate=16,
                                          index_n_heads=2, index_head_dim=32, index_topk=16, hc_mult=4,
                                          hash_layers=1),
        moe=v4_moe(num_experts=8, top_k=2, hidden_dim=128)),
    # DeepSeek-V4-Flash (284B-A13B): transformers 5.23's DeepseekV4Config defaults (its checkpoint is
    # deepseek-ai/DeepSeek-V4-Flash-Base) and its default schedule; the published config.json's own
    # schedule and compressed-RoPE YaRN are not known offline.
    "Flash": deepseek_v4_args(
        dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_dim=64, window=128, vocab_size=129280,
        attention=CompressedAttentionArgs(q_lora_rank=1024, o_groups=8, o_lora_rank=1024),
        moe=v4_moe(num_experts=256, top_k=6, hidden_dim=2048)),
    # DeepSeek-V4-Pro (1.6T-A49B): no transformers default or docstring gives its whole shape; torchtitan's
    # deepseek_v4 flavors do (pytorch/torchtitan torchtitan/models/deepseek_v4/flavors.py, _deepseek_v4_pro,
    # in the code corpus): its schedule (compress ratios 128, then 128 and 4 alternating: HCA, then HCA and
    # CSA), top-1024 of the indexer, 384 experts of 3072, route scale 2.5 and YaRN factor 16 over 65536
    # positions on the compressed RoPE.
    "Pro": deepseek_v4_args(
        dim=7168, n_layers=61, n_heads=128, head_dim=512, rope_dim=64, window=128, vocab_size=129280,
        layer_types=(HCA,) + (HCA, CSA) * 30,
        attention=CompressedAttentionArgs(q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024,
                                          compress_yarn=(16.0, 65536, 32.0, 1.0)),
        moe=v4_moe(num_experts=384, top_k=6, hidden_dim=3072, route_scale=2.5)),
}
