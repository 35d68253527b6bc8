"""DeepSeek-V4 under context parallel (titanctl/parallel/layouts/sequence_pieces.py) is one process: the whole
model (a CSA layer with its indexer and indexer loss, an HCA layer, a sliding-window layer; a hash-routed MoE
layer) run as cp ranks, each holding its two head-tail chunks, equals the model over the whole sequence in
fp64: logits, the indexer's top-k selection entry for entry, and every parameter's gradient, in sparse steps
and in the indexer's dense warm-up.

The window (8) spans a CP 2 chunk (8 tokens) minus one, and two CP 4 chunks (4 tokens): the rows before a
chunk come from one or several chunks back. 32 tokens: the CSA layer has 16 compressed entries of which the
indexer keeps 3. The ranks are threads of this process, each with its own copy of the model (the same
weights), and the all-gather a cat of their pieces (one autograd graph, one backward), so what is checked is
the exchange itself; tests/distributed/test_deepseek_v4_layouts.py checks it on gloo inside training."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.unit.models.families import deepseek_v4_fp64
from tests.unit.parallel.thread_ranks import FakeMesh, ThreadGather, run_ranks
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, DeepseekV4Args
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.sequence_pieces import HeadTailPieces, holds_sequence_pieces

ARGS = DeepseekV4Args(
    vocab_size=64, dim=32, n_layers=3, n_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, sliding_window=8, layer_types=(CSA, HCA, SLIDING), compress_rates={CSA: 2, HCA: 4},
    index_n_heads=2, index_head_dim=8, index_topk=3, hc_mult=2, num_experts=4, top_k=2, moe_hidden_dim=16,
    mlp_layer_types=("hash_moe", "moe", "moe"), indexer_loss_coeff=0.5)
SEQ = 32
LAYER = "0"  # the CSA layer


def model_and_tokens():
    model = deepseek_v4_fp64(ARGS)
    return model, torch.randint(0, ARGS.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


def record_selection(model, into: list) -> None:
    model.layers[LAYER].self_attn.indexer.register_forward_hook(lambda m, a, out: into.append(out[0]))


def one_process(model, tokens):
    """(logits, {name: gradient}, the indexer's selection (B, S, n)) of the mean next-token loss."""
    chosen = []
    record_selection(model, chosen)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, chosen[0]


def context_parallel(model, tokens, cp: int):
    """The same over cp thread ranks, as the trainer runs them: each rank's summed loss / (tokens / cp) and its
    indexer loss, backward, the ranks' gradients averaged (FSDP's reduce over cp)."""
    order = load_balanced_order(SEQ, cp)
    mine = order.view(cp, -1)
    gather = ThreadGather(cp)
    copies = [copy.deepcopy(model) for _ in range(cp)]
    logits, losses, chosen = [None] * cp, [None] * cp, [[] for _ in range(cp)]

    def rank(r: int) -> None:
        pieces = HeadTailPieces(FakeMesh(cp, r))
        pieces._gather = lambda t: gather(r, t)
        for block in copies[r].layers.values():
            block.self_attn.sequence_pieces = pieces
        record_selection(copies[r], chosen[r])
        out = copies[r](tokens[:, :-1][:, mine[r]])
        labels = tokens[:, 1:][:, mine[r]]
        # the trainer's divisor: the global token count / cp, this rank's count
        losses[r] = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        logits[r] = out

    run_ranks(cp, rank, gather.barrier)
    torch.stack(losses).sum().backward()
    back = torch.argsort(order)
    grads = {n: sum(dict(c.named_parameters())[n].grad for c in copies) / cp
             for n, p in copies[0].named_parameters() if p.grad is not None}
    selection = torch.cat([c[0] for c in chosen], dim=1)[:, back]
    return torch.cat(logits, dim=1).detach()[:, back], grads, selection


@pytest.mark.parametrize("cp, warmup", [(2, False), (4, False), (2, True)], ids=["cp2", "cp4", "cp2_warmup"])
def test_deepseek_v4_context_parallel_is_one_process(cp, warmup):
    """``warmup``: the indexer's dense warm-up step (every visible entry attended, the indexer alone trains)."""
    model, tokens = model_and_tokens()
    if warmup:
        model.v4 = dataclasses.replace(model.v4, indexer_warmup_steps=1)
        model.set_training_step(0, 1)
    ref_logits, ref_grads, ref_chosen = one_process(copy.deepcopy(model), tokens)
    logits, grads, chosen = context_parallel(model, tokens, cp)
    assert ref_chosen.sum(-1).max() == ARGS.index_topk and (ref_chosen.sum(-1) < SEQ // 2).all()  # it selects
    if warmup:  # only the indexer's weights get a gradient
        assert ref_grads and all(".indexer." in n for n in ref_grads)
    assert torch.equal(chosen, ref_chosen)
    assert (logits - ref_logits).abs().max() < 1e-12
    assert grads.keys() == ref_grads.keys()
    assert any(".indexer." in n for n in grads) and (warmup or any(".self_attn.compressor." in n for n in grads))
    for name, ref in ref_grads.items():
        assert (grads[name] - ref).abs().max() <= 1e-10 * ref.abs().max().clamp_min(1e-30), name
    assert holds_sequence_pieces(model)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=[CSA, HCA, SLIDING])
def test_the_planner_counts_a_cp_ranks_scores(layer):
    """Under CP 2 the largest tensor one attention layer saves on a rank is its probabilities: per query token
    ``attention_scores(args, layer, cp)`` + one sink per head (a chunk over its rows, the window's rows before
    it and every entry), which the planner's shape gives at that degree; below one process's count."""
    from tests.unit.planning.test_deepseek_v4_planning import tiny_args
    from titanctl.models.deepseek_v4.args import v4_args
    from titanctl.models.deepseek_v4.attention import Attention
    from titanctl.models.deepseek_v4.spec import attention_scores
    from titanctl.planning.plan.workload import model_shape

    cp, seq = 2, 128
    args = tiny_args(seq)
    torch.manual_seed(0)
    attn = Attention(v4_args(args), layer)
    x = torch.randn(1, seq, args.dim)
    mine = load_balanced_order(seq, cp).view(cp, -1)
    gather, saved = ThreadGather(cp), []

    def rank(r: int) -> None:
        pieces = HeadTailPieces(FakeMesh(cp, r))
        pieces._gather = lambda t: gather(r, t)
        layer_copy = copy.copy(attn)  # the same parameters, this rank's pieces
        layer_copy.sequence_pieces = pieces
        inputs = x[:, mine[r]].requires_grad_()
        if r == 0:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
                layer_copy(inputs)
        else:
            layer_copy(inputs)

    run_ranks(cp, rank, gather.barrier)
    per_token = attention_scores(args, layer, cp)
    assert max(saved) == seq // cp * (per_token + args.n_heads)
    assert model_shape(args).blocks[layer].scores(cp) == per_token < attention_scores(args, layer)
