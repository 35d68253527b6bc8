"""Hyper-parameters of the decoder-only transformer that every family builds.

One dataclass for all families: a family is a set of flavors (published dimensions plus the
switches below), not a subclass. Every default is that of the first family titanctl had, so a
ModelArgs written before a switch existed (a checkpoint's titanctl.json) still means the model it meant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# RoPE layouts: which channels of a head rotate together.
#   "interleaved": pairs (2i, 2i+1), Meta's layout (its original weights, torchtune).
#   "halves": pairs (i, i + head_dim/2), Hugging Face's "rotate_half" (most weights published there).
# The two give the same model once wq/wk rows are permuted within each head.
ROPE_LAYOUTS = ("interleaved", "halves")


@dataclass(frozen=True)
class RopeScaling:
    """Frequency-dependent RoPE scaling (long-context extension): wavelengths beyond the original context
    over ``low_freq_factor`` are slowed by ``factor``, those within it over ``high_freq_factor`` kept, a
    ramp between."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (long-context extension), as Hugging Face's ``yarn`` rope_parameters.

    Frequencies are interpolated by ``factor`` below ``beta_slow`` rotations over the original
    context and kept above ``beta_fast``, with a linear ramp between. ``mscale`` / ``mscale_all_dim``
    set the factor on cos and sin (their ratio of mscales) and, with ``mscale_all_dim``, the softmax scale
    (its mscale for ``mscale_all_dim``, squared)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    # Round the ramp's ends to whole pairs (transformers' default; some configs publish truncate = false).
    truncate: bool = True


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head Latent Attention: queries (optionally through a low-rank
    bottleneck) and keys/values through a compressed latent; RoPE on a slice of each head only."""

    q_lora_rank: int  # 0: queries straight from the input (wq), else wq_a -> norm -> wq_b
    kv_lora_rank: int  # width of the compressed key/value latent
    qk_nope_head_dim: int  # per-head query/key channels without RoPE
    qk_rope_head_dim: int  # per-head query/key channels with RoPE (the key's are shared by all heads)
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# "softmax": over all experts, before the choice; "sigmoid": each expert's own; "softmax_topk": over the
# top_k chosen logits only, so the chosen weights sum to 1 whatever norm_topk_prob says.
# "sqrtsoftplus": each expert's own sqrt(softplus(logit)).
SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk", "sqrtsoftplus")
# "swiglu": w2(silu(w1 x) * w3 x), the shared experts. "clamped_swiglu": gate and up rows interleaved in one
# stack w13 with a bias b13, gate clamped above and up on both sides at swiglu_limit, then
# w2(gate * sigmoid(swiglu_alpha * gate) * (up + 1)) + b2.
# "clamped_silu": w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)), no bias (the shared expert clamped
# too).
EXPERT_KINDS = ("swiglu", "clamped_swiglu", "clamped_silu")
# Attention kinds of a layer (ModelArgs.layer_types), named as Hugging Face's layer_types.
# "linear_attention": a Gated DeltaNet layer (ModelArgs.linear_attention) in place of softmax attention.
# "compressed_sparse_attention" / "heavily_compressed_attention": a sliding window plus compressed entries
# (ModelArgs.compressed_attention).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "compressed_sparse_attention",
               "heavily_compressed_attention")


@dataclass(frozen=True)
class LinearAttentionArgs:
    """Gated DeltaNet (linear attention with a gated delta-rule state): queries and keys of
    ``num_key_heads`` heads, each serving ``num_value_heads // num_key_heads`` value heads, a causal
    depthwise conv of ``conv_kernel`` taps over the q/k/v channels, and one (key_head_dim x
    value_head_dim) state per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: queries, keys, then values."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class CompressedAttentionArgs:
    """Compressed sparse attention and a hyper-connection residual: shared-KV MQA over a sliding window
    (ModelArgs.sliding_window), queries through a ``q_lora_rank`` latent, plus per layer
    (ModelArgs.layer_types) compressed entries: one per ``csa_rate`` tokens, chosen per query by a
    lightning indexer (top ``index_topk``), or one per ``hca_rate`` tokens, all visible. Heads in
    ``o_groups`` groups projected to ``o_lora_rank`` each before the output linear; the residual as
    ``hc_mult`` hyper-connection streams; the first ``hash_layers`` MoE layers route by a fixed
    token -> experts table."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    csa_rate: int = 4
    hca_rate: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    compress_rope_theta: float = 160000.0
    # YaRN on the compressed layers' RoPE (factor, original context, beta_fast, beta_slow), cos/sin unscaled.
    compress_yarn: tuple[float, int, float, float] | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: int = 3
    # The indexer's training (model.indexer_loss_coeff, model.indexer_warmup_steps): the weight of its KL loss
    # (0: off), and the first steps, which attend densely and train the indexer alone.
    indexer_loss_coeff: float = 0.0
    indexer_warmup_steps: int = 0


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int
    hidden_dim: int  # FFN width of each routed expert
    score_func: str = "softmax"  # one of SCORE_FUNCS
    norm_topk_prob: bool = True  # renormalize the k chosen weights to sum to 1
    route_scale: float = 1.0  # routed scaling factor
    num_shared_experts: int = 0  # a dense SwiGLU of num_shared_experts * hidden_dim beside the routed ones
    first_dense_layers: int = 0  # the first layers keep a dense FFN of ModelArgs.ffn_hidden_dim
    # Group-limited routing: experts form n_group equal groups, each scored by the sum of
    # its two best biased scores; a token's top_k experts come from its topk_group best groups.
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False  # the router's linear has a bias
    expert_kind: str = "swiglu"  # one of EXPERT_KINDS
    swiglu_limit: float = 7.0  # clamped_swiglu only
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    # The shared experts' output scaled by sigmoid(a learned linear of the token).
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class ModelArgs:
    # The family these args build (a name of titanctl.models.registry): a checkpoint's titanctl.json
    # records it, and every tool finds the family's spec from the args alone. Older titanctl.json
    # files have no such field: they were all of the first family.
    family: str = "llama3"
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    max_seq_len: int = 8192  # length of the RoPE table; the trainer sets it to training.seq_len
    # Scale the std of each block's output projections by its depth (else by the model depth).
    depth_init: bool = True
    # "rmsnorm" (written out in PyTorch ops) or "fused_rmsnorm" (F.rms_norm): same weights and math.
    norm_type: str = "rmsnorm"
    # Width of one attention head; None derives it as dim // n_heads. Some families publish it
    # separately (e.g. dim 1024, 16 heads of 128). Read it through the `head_dim` property.
    explicit_head_dim: int | None = None
    # FFN hidden width; None derives it from dim, multiple_of and ffn_dim_multiplier (Meta's
    # params.json). Families that publish `intermediate_size` set it. Read it through `ffn_hidden_dim`.
    explicit_ffn_hidden_dim: int | None = None
    # RMSNorm over head_dim of each query and key head, after the projections and before RoPE.
    qk_norm: bool = False
    rope_layout: str = "interleaved"  # one of ROPE_LAYOUTS
    # The output layer reuses the embedding table (one Parameter), as small published models do.
    tie_embeddings: bool = False
    # Mixture-of-Experts feed-forward in (some) blocks; None: every block is dense.
    moe: MoEArgs | None = None
    # Multi-head Latent Attention in place of grouped-query attention; None: GQA.
    mla: MLAArgs | None = None
    # YaRN RoPE scaling, in place of rope_scaling (then None).
    yarn: YarnScaling | None = None
    # Multi-token prediction depths: depth k predicts the token k + 1 ahead through a
    # block of its own, ``layers.{n_layers + k - 1}``, after the n_layers of the main model. 0: none.
    mtp_layers: int = 0
    # Biases on the attention's q, k, v and output projections.
    attention_bias: bool = False
    # A learned logit per query head that joins each softmax and attends to no value (attention
    # sinks): the weights of the real keys then sum to less than 1.
    attention_sinks: bool = False
    # Each layer's attention kind, repeated over the layers (layer i has layer_types[i % len]):
    # "sliding_attention" sees the last sliding_window positions (itself included), "full_attention"
    # all before it. Empty: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    # The "linear_attention" layers' Gated DeltaNet; None: the model has none.
    linear_attention: LinearAttentionArgs | None = None
    # Channels of each head that RoPE rotates (the first ones, "partial RoPE"); 0: all of them.
    partial_rope_dim: int = 0
    # Softmax attention's output scaled per channel by sigmoid of a gate that wq also projects (wq's
    # rows per head: head_dim query rows, then head_dim gate rows).
    attention_output_gate: bool = False
    # RMSNorms scale by (1 + weight), their weight starting at zero (zero-centred), not by weight.
    norm_offset: bool = False
    # Compressed attention, hyper-connections and hash routing; None: the model has none.
    compressed_attention: CompressedAttentionArgs | None = None

    def is_sliding_layer(self, layer_id: int) -> bool:
        types = self.layer_types
        return bool(types) and types[layer_id % len(types)] == "sliding_attention"

    def is_linear_attention_layer(self, layer_id: int) -> bool:
        types = self.layer_types
        return bool(types) and types[layer_id % len(types)] == "linear_attention"

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.moe.first_dense_layers

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Channels of a head that RoPE rotates: all of them, MLA's rope slice, or the partial RoPE's."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.partial_rope_dim or self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.explicit_ffn_hidden_dim is not None:
            return self.explicit_ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)
