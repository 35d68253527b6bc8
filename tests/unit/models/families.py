"""The families the conformance suite (test_conformance.py) runs over: for each, one or more tiny
transformers references built in-process (unit-scale weights, fixed seeds) and the published sizes of its
flavors. A new family adds its entries here; its own test file keeps only tests of its own mechanisms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.unit.hf_reference import saved_state_dict, unit_scale_

# Default RoPE of the dense references; the scaled ones (frequency-dependent, YaRN) where a family has them.
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # every pair of head_dim 8 scaled
LLAMA32_ROPE = {**LLAMA3_ROPE, "factor": 32.0}
V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
GPT_OSS_WINDOW = 8
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}



def recipe_in_layout(repo, recipe: str, world: int, vocab: int = 4352):
    """(config, dims, model args) of a shipped recipe at ``world`` ranks, after train's layout checks."""
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    cfg = load_config(repo / "recipes" / f"{recipe}.toml")
    dims = ParallelDims.from_config(cfg.parallelism, world)
    args = model_args_from_config(cfg.model, vocab, cfg.training.seq_len)
    check_layout(cfg, dims, args)
    return cfg, dims, args

def llama_config(tied: bool = False, rope: dict = LLAMA3_ROPE):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64, rope_parameters=rope,
        tie_word_embeddings=tied)


def qwen3_config(tied: bool = False):
    """head_dim 32 over dim 64 / 4 heads = 16: the explicit head width is what makes the shapes work."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=64,
        rope_parameters=DEFAULT_ROPE, tie_word_embeddings=tied)


def qwen3_model(args):
    """A Qwen3ForCausalLM of ``args``' dimensions (titanctl's ModelArgs), with unit-scale weights."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}, tie_word_embeddings=args.tie_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    unit_scale_(model)
    return model.eval()


def qwen3_moe_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64, rope_parameters=DEFAULT_ROPE,
        tie_word_embeddings=False)


# Qwen3.5: four layers (three Gated DeltaNet, then gated full attention), 2 key heads serving 4 value heads
# of 16 (heads of 8 let an L2 norm of a near-zero key amplify fp32 rounding past 1e-4 by the last layer),
# RoPE on half of each 16-channel head, theta 1e7 as published.
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5}
QWEN3_5_SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                     max_position_embeddings=64, rope_parameters=QWEN3_5_ROPE, tie_word_embeddings=False)


def qwen3_5_config(**changes):
    import transformers

    return transformers.Qwen3_5TextConfig(**{**QWEN3_5_SHAPE, "intermediate_size": 96, **changes})


def qwen3_5_moe_config(**changes):
    import transformers

    return transformers.Qwen3_5MoeTextConfig(**{**QWEN3_5_SHAPE, "moe_intermediate_size": 32,
                                                "shared_expert_intermediate_size": 32, "num_experts": 8,
                                                "num_experts_per_tok": 2, **changes})


def qwen3_next_config(**changes):
    """Qwen3.5's shape with Qwen3-Next's MoE, its first layer dense (``mlp_only_layers``), so that the fused
    Gated DeltaNet projections, the dense prefix and the gated shared expert are all compared."""
    import transformers

    return transformers.Qwen3NextConfig(**{**QWEN3_5_SHAPE, "intermediate_size": 96, "moe_intermediate_size": 32,
                                           "shared_expert_intermediate_size": 32, "num_experts": 8,
                                           "num_experts_per_tok": 2, "mlp_only_layers": [0], **changes})


# DeepSeek-V3 with every mechanism on: a dense first layer, 8 routed experts in 4 groups (top-2 from the 2
# best), a shared expert; with and without q LoRA, YaRN, and DeepSeek's interleaved RoPE pairs.
DEEPSEEK_V3_VARIANTS = {
    "q_lora-yarn-interleaved": dict(q_lora_rank=48, rope_parameters=V3_ROPE, rope_interleave=True),
    "no_q_lora-default_rope-halves": dict(q_lora_rank=None, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                          rope_interleave=False),
}


def deepseek_v3_config(**changes):
    import transformers

    return transformers.DeepseekV3Config(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "max_position_embeddings": 4096 * 40, "rms_norm_eps": 1e-6,
        "num_mtp_layers": 0, "tie_word_embeddings": False, **changes,
    })


def gpt_oss_config(**changes):
    import transformers

    config = transformers.GptOssConfig(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 2, "sliding_window": GPT_OSS_WINDOW, "max_position_embeddings": 4096 * 32,
        "rope_parameters": GPT_OSS_ROPE, "tie_word_embeddings": False, **changes,
    })
    config._attn_implementation = "eager"  # the reference softmax with its sinks
    return config


def gpt_oss_model(**changes):
    """A GptOssForCausalLM of ``gpt_oss_config(**changes)``, at unit scale with real sinks (seed 0)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(gpt_oss_config(**changes)).eval()
    gen = torch.Generator().manual_seed(0)
    unit_scale_(model, gen)
    real_sinks(model, gen)
    return model


# DeepSeek-V4: every attention kind (CSA, HCA, sliding), the first layer hash-routed, YaRN on the compressed
# branches as published (factor 16) over a context the 48 tokens exceed; over a window of 8 most keys are
# compressed entries (CSA: 24 at rate 2, of which the indexer keeps 3; HCA: 12 at rate 4).
V4_COMPRESS_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                    "beta_slow": 1.0}


def deepseek_v4_config():
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=512, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], rope_parameters=V4_COMPRESS_YARN,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, index_n_heads=2,
        index_head_dim=8, index_topk=3, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
        num_nextn_predict_layers=0)  # transformers builds no depth (its default 1 declares one it lacks)


def deepseek_v4_fp64(args):
    """titanctl's DeepSeek-V4 of ``args`` in fp64, every parameter drawn N(0, 0.3) (seed 0): far from ties."""
    from titanctl.models.deepseek_v4.model import DeepseekV4

    torch.manual_seed(0)
    model = DeepseekV4(args).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.init_buffers()
    return model


def deepseek_v4_state(model, gen: torch.Generator) -> None:
    """DeepSeek-V4's state unit scale leaves at rest: a trained expert bias, and a token -> experts table
    unlike titanctl's seeded one (two distinct experts per token), so that reading it is what makes the
    logits equal."""
    trained_expert_bias(model, gen)
    with torch.no_grad():
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                table.copy_(torch.rand(table.shape[0], experts, generator=gen).argsort(-1)[:, : table.shape[1]])


def trained_expert_bias(model, gen: torch.Generator) -> None:
    """DeepSeek-V3's e_score_correction_bias as training leaves it: it moves the choice of experts."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def real_sinks(model, gen: torch.Generator) -> None:
    """gpt-oss's sinks taking a real share of each softmax, some heads more."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2.0 + 2.0 * torch.randn(layer.self_attn.sinks.shape, generator=gen))


@dataclass(frozen=True)
class Reference:
    """One tiny transformers model of a family, and what the suite expects of titanctl against it."""

    case: str
    family: str
    model_class: str  # transformers' *ForCausalLM
    config: Callable[[], Any]
    tol: float = 1e-4  # max |Δlogit| in fp32
    after_init: Callable[[Any, torch.Generator], None] | None = None  # state unit_scale_ does not set
    # config.json facts an export keeps, beyond the round trip's (the family's own keys)
    exported: Callable[[dict, Any], None] = field(default=lambda config, theirs: None)
    # transformers holds the model under other names than save_pretrained writes (DeepSeek-V4's conversion
    # mapping): titanctl reads the written ones, so the suite feeds it those (``hf_state_dict``).
    saved_names_only: bool = False

    def hf_state_dict(self, theirs) -> dict:
        """The reference's weights under the names titanctl reads."""
        return saved_state_dict(theirs) if self.saved_names_only else theirs.state_dict()

    def build(self):
        """The reference, its weights at unit scale (seed 0), in eval mode."""
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, self.model_class)(self.config()).eval()
        gen = torch.Generator().manual_seed(0)
        unit_scale_(model, gen)
        if self.after_init is not None:
            self.after_init(model, gen)
        return model


def _deepseek_v3_export(config: dict, theirs) -> None:
    assert config["max_position_embeddings"] == 4096 * 40 and config["rope_theta"] == 10000.0
    if config["rope_parameters"]["rope_type"] == "yarn":  # transformers 4.x reads YaRN from rope_scaling only
        yarn = {key: value for key, value in config["rope_parameters"].items() if key != "rope_theta"}
        assert config["rope_scaling"] == {**yarn, "type": "yarn"}


def _gpt_oss_export(config: dict, theirs) -> None:
    assert config["layer_types"] == theirs.config.layer_types


def _qwen3_5_export(config: dict, theirs) -> None:
    assert config["layer_types"] == theirs.config.layer_types
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5


def _deepseek_v4_export(config: dict, theirs) -> None:
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"):
        assert config[key] == getattr(theirs.config, key), key


def _qwen3_next_export(config: dict, theirs) -> None:
    _qwen3_5_export(config, theirs)
    assert (config["mlp_only_layers"], config["decoder_sparse_step"], config["intermediate_size"]) == ([0], 1, 96)


def _qwen3_moe_export(config: dict, theirs) -> None:
    # What the model does not use or titanctl's args do not hold comes back as the source had it.
    assert (config["intermediate_size"], config["max_position_embeddings"], config["num_local_experts"]) == (96, 64, 8)
    assert config["num_experts"] == 8  # for transformers 4.x


REFERENCES = [
    Reference("llama3", "llama3", "LlamaForCausalLM", llama_config),
    Reference("llama3-tied", "llama3", "LlamaForCausalLM", lambda: llama_config(tied=True, rope=LLAMA32_ROPE)),
    Reference("qwen3", "qwen3", "Qwen3ForCausalLM", qwen3_config),
    Reference("qwen3-tied", "qwen3", "Qwen3ForCausalLM", lambda: qwen3_config(tied=True)),
    Reference("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config, exported=_qwen3_moe_export),
    *(Reference(f"deepseek_v3-{name}", "deepseek_v3", "DeepseekV3ForCausalLM",
                lambda changes=changes: deepseek_v3_config(**changes), after_init=trained_expert_bias,
                exported=_deepseek_v3_export)
      for name, changes in DEEPSEEK_V3_VARIANTS.items()),
    Reference("gpt_oss", "gpt_oss", "GptOssForCausalLM", gpt_oss_config, tol=1e-5, after_init=real_sinks,
              exported=_gpt_oss_export),
    Reference("qwen3_5", "qwen3_5", "Qwen3_5ForCausalLM", qwen3_5_config, exported=_qwen3_5_export),
    # Tied, the std-1 table is the output layer: logits reach 67 (not ~10), and each Gated DeltaNet layer
    # amplifies a difference in its input about 10x (its L2 and RMS norms of small vectors), in
    # transformers' model as in titanctl's: max |Δlogit| 2.4e-4, 3.6e-6 of the largest logit.
    Reference("qwen3_5-tied", "qwen3_5", "Qwen3_5ForCausalLM", lambda: qwen3_5_config(tie_word_embeddings=True),
              tol=3e-4),
    Reference("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeForCausalLM", qwen3_5_moe_config, exported=_qwen3_5_export),
    Reference("deepseek_v4", "deepseek_v4", "DeepseekV4ForCausalLM", deepseek_v4_config, after_init=deepseek_v4_state,
              exported=_deepseek_v4_export, saved_names_only=True),
    Reference("qwen3_next", "qwen3_next", "Qwen3NextForCausalLM", qwen3_next_config, exported=_qwen3_next_export),
]

# Published sizes: (family, flavor) -> (total parameters, relative tolerance; 0: exact). Llama with its
# tokenizer's 128,256 rows (its flavors take the vocabulary from the tokenizer), the others as published.
PUBLISHED_SIZES = {
    ("llama3", "8B"): (8_030_261_248, 0),
    ("llama3", "70B"): (70_553_706_496, 0),
    ("llama3", "405B"): (405_853_388_800, 0),
    ("llama3", "1B"): (1_235_814_400, 0),  # published 1.23B: the tied table counted once
    ("llama3", "3B"): (3_212_749_824, 0),  # 3.21B
    ("qwen3", "0.6B"): (596_049_920, 0),  # embedding counted once: 155.6M + 28 x 15.7M + 1024
    ("qwen3", "1.7B"): (1.7e9, 0.02),
    ("qwen3", "4B"): (4.0e9, 0.02),
    ("qwen3", "8B"): (8.2e9, 0.02),
    ("qwen3", "14B"): (14.8e9, 0.02),
    ("qwen3", "32B"): (32.8e9, 0.02),
    ("qwen3_moe", "30B-A3B"): (30.53e9, 1e-3),
    ("qwen3_moe", "235B-A22B"): (235.09e9, 1e-3),
    ("deepseek_v3", "16B"): (15.71e9, 1e-3),  # DeepSeek's counts
    ("deepseek_v3", "671B"): (671.03e9, 1e-3),
    ("gpt_oss", "20b"): (20.91e9, 1e-3),  # OpenAI's model card
    ("gpt_oss", "120b"): (116.83e9, 1e-3),
    # The name's 35B, text only: the Hub's checkpoint adds a vision tower (~0.4B) titanctl does not build.
    ("qwen3_5_moe", "35B-A3B"): (35e9, 0.02),
    ("qwen3_5_moe", "397B-A17B"): (397e9, 0.01),  # text only: 396.35B (the name counts the vision tower and MTP)
    # The name's 80B, text only: 79.67B measured; the Hub's checkpoint adds a multi-token-prediction block.
    ("qwen3_next", "80B-A3B"): (80e9, 0.01),
    ("deepseek_v4", "Flash"): (284e9, 2e-3),  # the name's 284B-A13B (measured: 284.33B, 13.26B active)
}
# Families with no published flavor yet, and why: their sizes join PUBLISHED_SIZES with the flavors.
UNPUBLISHED = {
    "qwen3_5": "the dense sizes' Gated DeltaNet widths were not readable offline (no config.json of the Hub here)",
}
# Families with no REFERENCES entry yet, and why: their parity against transformers is in their own file
# until their Hugging Face names exist (the suite's round trips need them).
NOT_IN_SUITE: dict[str, str] = {}
LLAMA3_TOKENIZER_ROWS = 128_256
