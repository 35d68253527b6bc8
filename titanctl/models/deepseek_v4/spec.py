"""DeepSeek-V4's spec: its own decoder (compressed sparse attention, hyper-connections, hash-routed MoE),
under FSDP, expert parallelism (every MoE layer's routed experts, hash-routed ones too), pipeline stages,
tensor parallelism (tp_plan.py), DDP/HSDP and ring context parallelism (its attention fetches its neighbours'
rows through ``sequence_pieces``); Ulysses refuses in one line; the Hugging Face format is hf.py's."""

from __future__ import annotations

import functools

import torch
from torch import nn

from titanctl.errors import ConfigError, ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.deepseek_v4.args import CSA, DEEPSEEK_V4_FLAVORS, HCA, SLIDING, v4_args
from titanctl.models.deepseek_v4.hf import HF
from titanctl.models.deepseek_v4.model import DeepseekV4, split_into_stage
from titanctl.models.deepseek_v4.tp_plan import DEEPSEEK_V4_TP_PLAN
from titanctl.models.spec import ModelSpec


def build(args: ModelArgs) -> nn.Module:
    return DeepseekV4(v4_args(args), args)


def check_run(args: ModelArgs) -> None:
    """The schedule, and the indexer's top-k against the compressed length of the run's sequences."""
    try:
        v4_args(args).check(seq_len=args.max_seq_len)
    except ValueError as err:
        raise ConfigError(f"model {args.family}: {err}") from None


def check_context_parallel(args: ModelArgs, seq_len: int, cp: int, method: str) -> None:
    """Ring context parallel only, in chunks (seq_len / 2cp tokens) that hold whole compressed windows: each
    rank pools its own chunks' windows (titanctl/parallel/layouts/sequence_pieces.py)."""
    if method != "ring":
        raise ParallelError(f"{args.family} does not run with context_parallel_method = {method} (its attention "
                            "reads its neighbours by sequence chunks, not by heads); use context_parallel_method "
                            "= ring")
    chunk = seq_len // (2 * cp)
    ca = args.compressed_attention
    for kind, rate in ((CSA, ca.csa_rate), (HCA, ca.hca_rate)):
        if kind in args.layer_types and chunk % rate:
            raise ParallelError(f"context_parallel_degree = {cp} cuts training.seq_len {seq_len} into 2 x cp chunks "
                                f"of {chunk} tokens, which do not hold whole {kind} windows of {rate}: use a seq_len "
                                f"that is a multiple of {2 * cp * rate} or a smaller degree")


@functools.cache
def _active_params(args: ModelArgs) -> int:
    """Matmul parameters a token uses: all but the embedding lookup, the indexer (it only ranks) and the
    routed experts it is not sent to."""
    with torch.device("meta"):
        model = build(args)
    total = 0
    for name, p in model.named_parameters():
        if name == "tok_embeddings.weight" and not args.tie_embeddings:
            continue
        n = p.numel()
        if ".mlp.experts." in name:
            n = n * args.moe.top_k // args.moe.num_experts
        total += n
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N for the N active parameters, plus each layer's scores and values over the keys a query sees (its
    window and, in CSA/HCA layers, the compressed entries it may pick: index_topk, or seq_len / rate):
    12 x heads x head_dim x keys, forward and backward. Each multi-token-prediction depth adds its block and
    projections (in N), its block's sliding-window attention and another pass through the shared output
    layer (its logits)."""
    ca = args.compressed_attention
    keys = 0
    for kind in (*args.layer_types, *(SLIDING,) * args.mtp_layers):  # the depths' blocks: windows
        seen = min(args.sliding_window, seq_len)
        if kind == CSA:
            seen += min(ca.index_topk, seq_len // ca.csa_rate)
        elif kind != SLIDING:
            seen += seq_len // ca.hca_rate // 2  # on average half the entries are closed before a query
        keys += seen
    shared_output = args.mtp_layers * args.dim * args.vocab_size
    return 6 * (_active_params(args) + shared_output) + 12 * args.n_heads * args.head_dim * keys


def attention_scores(args: ModelArgs, layer: int, cp: int = 1) -> int:
    """Per query token, the scores a layer's attention materializes: every head over the whole sequence's
    keys (the window is a mask, not a slice) and, in CSA/HCA layers, every compressed entry. Under context
    parallel a rank's chunk (seq / 2cp) attends its own rows and the window's rows before it, and every entry."""
    seq, ca, kind = args.max_seq_len, args.compressed_attention, args.layer_types[layer]
    entries = {CSA: seq // ca.csa_rate, HCA: seq // ca.hca_rate}.get(kind, 0)
    keys = seq if cp == 1 else seq // (2 * cp) + args.sliding_window - 1
    return args.n_heads * (keys + entries)


SPEC = ModelSpec(
    name="deepseek_v4",
    flavors=DEEPSEEK_V4_FLAVORS,
    build=build,
    tp_plan=DEEPSEEK_V4_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=flops_per_token,
    hf=HF,
    tokenizer_repo=("deepseek-ai/DeepSeek-V4-Flash", ""),
    check_run=check_run,
    attention_scores=attention_scores,
    check_context_parallel=check_context_parallel,
    # The indexer trains by its own loss alone: without it (model.indexer_loss_coeff 0) it gets no gradient,
    # and in its warm-up nothing else does.
    parameters_may_go_unused=True,
    moe_keys_not_built={
        "router_aux_loss_coef": "deepseek_v4's MoE layers have no auxiliary balancing loss",
    },
)
