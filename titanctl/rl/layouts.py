"""What a parallel layout means for sampling with the policy, and which layouts RL runs.

The sampler calls the training model itself. Under FSDP/HSDP each block's parameters are gathered once
for the whole rollout (``gathered``), not once per decoded token, and freed after it: a decode step then
runs no collective, and ranks may decode different numbers of steps (each stops when its own rows are
done). DDP holds whole parameters already.

Tensor parallelism: the policy is built with its family's TP plan *without sequence parallel*
(``build_model_parts(sequence_parallel=False)``): a decode step holds one token per row, which cannot be
split over the ranks, so activations stay whole on every rank between blocks. Each rank computes its
heads and hidden units, each row-parallel linear (wo, w2) and the vocabulary-split embedding all-reduce
their partial sums, the output layer all-gathers the logits, and sampler and trainer both take one
log-softmax over the whole vocabulary (no loss parallel: the logits are gathered whatever
parallelism.disable_loss_parallel says). The sampler runs these same DTensor modules, so decode and
training differ only in how many positions they compute (every sampled family's plan has that variant).
Every TP rank decodes the same rows in step: the logits are whole on each, so each draws the same tokens.
With ``rl.batch_invariant`` the one reduction that crosses ranks is that all-reduce. Under TP 2 it adds
two partial sums, one rounding whatever the order: bitwise the same in decode and training. Past 2, gloo
may add each element's partials in an order set by where the element falls in its chunks of the buffer,
whose size differs between decode (one token) and training (the sequence): refused. Pipeline and context
parallelism shard what a decode step computes (stages, sequence shards) and are refused here in one
line, before the model is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule

from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError, ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.parallel.layouts.data_parallel import reshard_after_forward_plan
from titanctl.parallel.layouts.dims import ParallelDims

# Families whose attention keeps a per-head KV cache (the sampler's RowCache); MLA caches latents.
SAMPLED_FAMILIES = ("llama3", "qwen3", "qwen3_moe", "gpt_oss")
BATCH_INVARIANT_FAMILIES = ("llama3", "qwen3", "qwen3_moe")  # their attention is torch's SDPA, which the mode swaps


def check_rl_layout(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """The layouts and models RL runs; anything else is a one-line error naming the key."""
    rl = cfg.rl
    for key, degree in (("pipeline_parallel_degree", dims.pp),
                        ("context_parallel_degree", dims.cp)):
        if degree > 1:
            raise ParallelError(
                f"parallelism.{key} = {degree}: titanctl rl samples with the training model, and a decode step "
                "cannot be split that way; use data, tensor and expert parallelism")
    if args.family not in SAMPLED_FAMILIES:
        raise ConfigError(f"model.name = {cfg.model.name!r}: titanctl rl samples the families whose every layer "
                          f"keeps a per-head KV cache ({', '.join(SAMPLED_FAMILIES)}); this one's layers cache "
                          "latents (MLA) or a recurrent state")
    if rl.batch_invariant:
        if dims.tp > 2:
            raise ParallelError(f"rl.batch_invariant with parallelism.tensor_parallel_degree = {dims.tp}: gloo sums "
                                "more than two partial sums in an order set by the tensor's size, so decode and "
                                "training round differently; use tensor_parallel_degree = 2")
        if args.family not in BATCH_INVARIANT_FAMILIES:
            raise ConfigError(f"rl.batch_invariant with model.name = {cfg.model.name!r}: its attention (sinks) has "
                              f"no batch-invariant kernel; the mode runs {', '.join(BATCH_INVARIANT_FAMILIES)}")
        for key, on in (("compile.enable", cfg.compile.enable), ("rl.compile_sampler", rl.compile_sampler)):
            if on:
                raise ConfigError(f"rl.batch_invariant runs eagerly: set {key} = false (a compiled kernel fuses and "
                                  "reorders reductions as the shapes suit it)")
    if rl.routing_replay:
        if args.moe is None:
            raise ConfigError(f"rl.routing_replay needs a Mixture-of-Experts model, not {cfg.model.name!r}")
        if rl.compile_sampler:
            raise ConfigError("rl.routing_replay records the sampler's routing in Python: set rl.compile_sampler = "
                              "false")
    if rl.prompts_per_step % dims.dp:
        raise ConfigError(f"config key 'rl.prompts_per_step' = {rl.prompts_per_step} must be a multiple of the "
                          f"data-parallel degree {dims.dp}: each rank samples the same number of prompts")


@contextmanager
def gathered(model: nn.Module, cfg: JobConfig) -> Iterator[None]:
    """FSDP: inside, every parameter stays gathered (one all-gather per module for the whole rollout);
    outside, sharded again as the layout shards it. A no-op for other layouts."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield
        return
    plan = reshard_after_forward_plan(model, cfg.parallelism.fsdp_reshard_after_forward, pipelined=False)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(plan.get(module, True), recurse=False)
