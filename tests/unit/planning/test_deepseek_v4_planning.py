"""What plan and estimate-memory count for DeepSeek-V4: its attention materializes its scores (every head over
the whole sequence's keys and the compressed entries), which the planner's memory model counts
(``spec.attention_scores``); the count against the probabilities the attention really saves, its memory
against torch's MemTracker on one layer; the V4-Pro flavor's size; the V4-Flash GPU recipe's layout fits."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tests.conftest import REPO
from titanctl.models.common.args import CompressedAttentionArgs
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, deepseek_v4_args, v4_args, v4_moe
from titanctl.models.deepseek_v4.attention import Attention
from titanctl.models.deepseek_v4.spec import attention_scores
from titanctl.models.registry import get_spec
from titanctl.planning.plan.workload import model_shape

SEQ = 256


def tiny_args(seq: int = SEQ):
    return deepseek_v4_args(
        dim=64, n_layers=3, n_heads=4, head_dim=32, rope_dim=8, window=16, vocab_size=128,
        layer_types=(CSA, HCA, SLIDING),
        attention=CompressedAttentionArgs(q_lora_rank=32, o_groups=2, o_lora_rank=16, csa_rate=4, hca_rate=16,
                                          index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=2,
                                          hash_layers=1),
        moe=v4_moe(num_experts=4, top_k=2, hidden_dim=32)).replace(max_seq_len=seq)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=[CSA, HCA, SLIDING])
def test_the_counted_scores_are_the_probabilities_the_attention_saves(layer):
    """The largest tensor one attention layer saves for backward is its probabilities (with the sink column):
    per query token exactly ``attention_scores`` + one sink per head, which the planner's shape carries."""
    args = tiny_args()
    torch.manual_seed(0)
    attn = Attention(v4_args(args), layer)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        attn(torch.randn(1, SEQ, args.dim, requires_grad=True))
    assert max(saved) == SEQ * (attention_scores(args, layer) + args.n_heads)
    assert model_shape(args).blocks[layer].attention_scores == attention_scores(args, layer)


def test_an_attention_layers_memory_is_about_four_copies_of_its_scores():
    """Forward and backward of one CSA layer (fp32, 512 tokens): the peak beyond its parameters and their
    gradients, per materialized score, is at most the memory model's 4 copies and within 12.5% of them
    (measured 3.52 since the window's (S, S) int64 distances are freed before the scores exist, 3.95 before;
    3.6-3.8 for V4-Flash's layers at 4096 tokens in bf16, on fake tensors)."""
    seq = 512
    args = tiny_args(seq)
    attn = Attention(v4_args(args), 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, seq, args.dim, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(attn, x)
    with tracker:
        attn(x).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    weights = 2 * 4 * sum(p.numel() for p in attn.parameters())
    copies = (peak - weights) / (seq * attention_scores(args, 0) * 4)
    assert 3.5 <= copies <= 4, copies


def test_the_pro_flavor_is_its_names_size():
    """DeepSeek-V4-Pro, 1.6T-A49B (torchtitan's flavor), from the planner's shape of it: 1572.99B parameters
    (the hyper-connection head aside), 48.85B of them active (the embedding lookup aside)."""
    args = get_spec("deepseek_v4").flavors["Pro"]
    shape = model_shape(args)
    blocks = sum(b.params(1, 1) for b in shape.blocks)
    total = blocks + shape.embedding_params + shape.output_params + shape.final_norm_params
    active = blocks - sum(b.expert_params(1) * (1 - b.experts.top_k / b.experts.count) for b in shape.blocks) + (
        shape.output_params)
    assert total == pytest.approx(1.6e12, rel=0.02) and active == pytest.approx(49e9, rel=0.01)
    assert len(args.layer_types) == 61 and args.layer_types[:3] == (HCA, HCA, CSA)


def test_the_flash_gpu_recipe_fits_by_the_fast_estimate():
    """recipes/deepseek_v4_flash.toml's own layout on 256 H100s (pp 4 x FSDP 64, experts over 64): under 80 GB
    (74.5 GiB) with 8 GiB to spare; its attention scores are a large share of it (estimate-memory's exact
    figure: docs/models.md)."""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.search import Planner, recipe_config

    path = REPO / "recipes" / "deepseek_v4_flash.toml"
    cfg = recipe_config(path)
    p, t = cfg.parallelism, cfg.training
    candidate = Candidate(1, 256 // p.pipeline_parallel_degree, 1, p.pipeline_parallel_degree, 1,
                          p.expert_parallel_degree, t.local_batch_size, 1, pp_schedule=p.pipeline_parallel_schedule,
                          pp_microbatch_size=p.pipeline_parallel_microbatch_size, ac="full")
    planner = Planner(str(path), cfg, devices.resolve_device("h100", None, {}))
    assert planner.shape.blocks[3].attention_scores == 64 * (4096 + 1024)  # a CSA layer: 64 heads, 4096 + 1024 keys
    assert 0 < planner.fast_memory(candidate) < (74.5 - 8) * 2**30


TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "1",
       "--parallelism.expert_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "1",
       "--training.local_batch_size", "1"]  # each recipe's own sequence length (V4-Flash's top-k needs it)


@pytest.mark.parametrize("recipe", ["recipes/deepseek_v4_debug.toml", "recipes/deepseek_v4_flash.toml"],
                         ids=["debug", "flash"])
def test_the_planner_splits_the_grouped_output_projection_as_tp_does(recipe):
    """Under TP 2 a rank holds half of ``o_a_proj``'s rows (its head groups) and half the sinks
    (``TPPlan.head_params``): the planner's count of each block's parameters on a rank is what the real layout
    (``apply_tp`` on fake tensors over a fake process group, as estimate-memory builds it) leaves there, to the
    parameter. Counted whole, ``o_a_proj`` made it 8,192 too many per block for the debug model and 16.8M for
    V4-Flash's (0.72B on a rank of the 43-layer model)."""
    from titanctl.config.recipe import load_config
    from titanctl.parallel.layouts.build import build_model_parts
    from titanctl.planning.memory import estimate as memory
    from titanctl.planning.memory.fake import fake_tensor_mode
    from titanctl.train.loss import cross_entropy_sum

    plan = memory.plan_estimate(load_config(REPO / recipe, TP2), 2)
    with memory.fake_process_group(2, 0):
        plan.dims.mesh  # noqa: B018 (built before fake mode)
        built = build_model_parts(plan.cfg, plan.dims, plan.args, torch.device("cpu"), loss_fn=cross_entropy_sum,
                                  init=False, fake_mode=fake_tensor_mode(allow_non_fake_inputs=True))
        on_rank = [sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in block.parameters())
                   for block in built.parts[0].layers.values()]
    blocks = model_shape(plan.args).blocks
    assert [b.params(2, 1) for b in blocks] == on_rank
    o_a = plan.args.n_heads * plan.args.head_dim * plan.args.compressed_attention.o_lora_rank
    assert all(b.params(1, 1) - b.params(2, 1) > o_a // 2 for b in blocks)  # o_a_proj's half and more
