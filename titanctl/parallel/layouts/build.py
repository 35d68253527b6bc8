"""How a recipe becomes (sharded) model parts: the one place `train` and `estimate-memory` share.

Model converters (float8 linears, LoRA adapters with the base frozen, then oneDNN fp32 linears on
CPU) run first, on the whole model on the meta device, so that their names are canonical and
every later step wraps the converted modules. Then, inside every model part (a whole model, or each pipeline stage):
TP -> EP -> activation checkpointing -> per-block compile -> FSDP/HSDP or DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanctl.config.job_config import JobConfig
from titanctl.errors import ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import build_model, spec_of
from titanctl.models.spec import no_extra
from titanctl.parallel.converters.float8 import (
    Float8Conversion,
    check_float8,
    communicates_float8,
    convert_to_float8,
    sends_float8,
)
from titanctl.parallel.converters.lora import LoRAConversion, apply_lora, check_lora, freeze_base
from titanctl.parallel.converters.onednn_linear import linear_kernel, use_onednn_linears
from titanctl.parallel.layouts.activation_checkpoint import apply_ac
from titanctl.parallel.layouts.context_parallel import check_cp_divisibility
from titanctl.parallel.layouts.data_parallel import apply_compile, apply_ddp, apply_fsdp
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.expert_parallel import apply_ep, expert_gradient_divide_factor
from titanctl.parallel.layouts.linear_attention_cp import (
    check_linear_attention_cp,
    enable_gated_deltanet_context_parallel,
)
from titanctl.parallel.layouts.linear_attention_ulysses import (
    check_gated_deltanet_ulysses,
    enable_gated_deltanet_ulysses,
)
from titanctl.parallel.layouts.pipeline_parallel import build_pipeline, plan_pipeline
from titanctl.parallel.layouts.pipeline_stages import SPLIT_BACKWARD_SCHEDULES
from titanctl.parallel.layouts.sequence_pieces import enable_sequence_pieces
from titanctl.parallel.layouts.tensor_parallel import apply_tp, check_tp
from titanctl.parallel.layouts.ulysses import check_ulysses, enable_ulysses
from titanctl.parallel.layouts.ulysses_ring import check_ulysses_ring, enable_ulysses_ring
from titanctl.parallel.layouts.weight_init import initialize_weights


@dataclass
class ModelParts:
    parts: list[nn.Module]
    pipeline: object | None = None  # titanctl.parallel.layouts.pipeline_parallel.Pipeline when pp > 1
    float8: Float8Conversion | None = None  # what became float8 (float8.enable_float8_linear)
    lora: LoRAConversion | None = None  # which modules got adapters (lora.enable)

    @property
    def has_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.has_last_stage


def check_pipelined_cp(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Context parallel inside pipeline stages is the ring over causal attention: the stages take the batch
    already cut by sequence. Masks (documents, gpt-oss's layers), Ulysses and Gated DeltaNet's scan are not
    built there."""
    p, why = cfg.parallelism, None
    if p.context_parallel_method != "ring":
        why = f"context_parallel_method = {p.context_parallel_method}"
    elif cfg.model.attn_mask_type != "causal":
        why = f"model.attn_mask_type = {cfg.model.attn_mask_type}"
    elif args.attention_sinks or "sliding_attention" in args.layer_types:
        why = f"{args.family}'s attention sinks and sliding windows"
    elif args.linear_attention is not None:
        why = f"{args.family}'s Gated DeltaNet layers"
    if why is not None:
        raise ParallelError(f"context_parallel_degree = {dims.cp} with pipeline_parallel_degree = {dims.pp} runs ring "
                            f"attention over causal masks only, not {why}; use one of the two degrees")


def check_layout(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> None:
    """Every layout error that the config and the model's shape decide: the Trainer raises them before
    its rank joins the process group, so a bad layout never leaves a rank half-connected."""
    p = cfg.parallelism
    for dim, why in spec_of(args).layouts_not_built.items():
        if getattr(dims, dim) > 1:
            raise ParallelError(f"{args.family} does not run with {dim} = {getattr(dims, dim)} yet ({why}); "
                                f"use a layout without it")
    if dims.tp > 1:
        check_tp(args, dims.tp, cfg.training.seq_len)
    elif p.enable_async_tensor_parallel:
        raise ParallelError("parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")
    if dims.cp > 1 and dims.pp > 1:
        check_pipelined_cp(cfg, args, dims)
    if dims.cp > 1 and p.context_parallel_method == "ulysses":
        check_gated_deltanet_ulysses(args, dims.tp, dims.cp)
        check_ulysses(args, dims.tp, dims.cp, cfg.training.seq_len)
    elif dims.cp > 1 and p.context_parallel_method == "ulysses_ring":
        check_ulysses_ring(dims.cp, dims.cp_ulysses, args.n_heads, dims.tp)
        if cfg.compile.enable:  # blocks compile whole (fullgraph): its all-to-alls and sends run eagerly
            raise ParallelError("context_parallel_method = ulysses_ring does not run under compile.enable (its "
                                "attention runs eagerly inside a whole-graph compiled block); "
                                "use compile.enable = false")
        # Gated DeltaNet layers: key heads over TP x the Ulysses ranks, then the scan's chunks over the ring groups
        check_gated_deltanet_ulysses(args, dims.tp, dims.cp_ulysses, "context_parallel_ulysses_degree")
        check_ulysses(args, dims.tp, dims.cp_ulysses, cfg.training.seq_len)
        check_cp_divisibility(cfg.training.seq_len, dims.cp)
        check_linear_attention_cp(args, cfg.training.seq_len, dims.cp // dims.cp_ulysses,
                                  "context_parallel_degree / context_parallel_ulysses_degree")
    elif dims.cp > 1:
        check_cp_divisibility(cfg.training.seq_len, dims.cp)
        check_linear_attention_cp(args, cfg.training.seq_len, dims.cp)
    if dims.cp > 1:
        spec_of(args).check_context_parallel(args, cfg.training.seq_len, dims.cp, p.context_parallel_method)
    if args.mtp_layers and (dims.pp > 1 or dims.cp > 1):
        which = f"pipeline_parallel_degree = {dims.pp}" if dims.pp > 1 else f"context_parallel_degree = {dims.cp}"
        reason = ("its depths need the embedding of the first stage and the output layer of the last"
                  if dims.pp > 1 else "its depths read the tokens ahead, which context parallel puts on other ranks")
        raise ParallelError(f"model.mtp_layers = {args.mtp_layers} (multi-token prediction) does not run under "
                            f"{which}: {reason}; set model.mtp_layers = 0 or use FSDP/HSDP, TP or EP")
    if args.mtp_layers and dims.tp > 1 and spec_of(args).tp_plan.extra is no_extra:
        # The depths' own norms and projections run on each rank's part of the sequence: a plan must place them
        # (DeepSeek-V3's does), or their gradients would be one part's.
        raise ParallelError(f"model.mtp_layers = {args.mtp_layers} (multi-token prediction) does not run under "
                            f"tensor_parallel_degree = {dims.tp} for {args.family} yet (its tensor-parallel plan does "
                            "not place the prediction depths); set model.mtp_layers = 0 or use FSDP/HSDP or EP")
    if dims.ddp_enabled and dims.tp > 1:
        raise ParallelError(
            f"DDP (data_parallel_replicate_degree = {dims.dp_replicate}) does not compose with "
            f"tensor_parallel_degree = {dims.tp}: use data_parallel_shard_degree > 1 (HSDP) instead"
        )
    ac = cfg.activation_checkpoint
    if dims.pp > 1 and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES and ac.mode == "selective" \
            and ac.selective_ac_option == "op":
        raise ParallelError(
            f"pipeline_parallel_schedule = {p.pipeline_parallel_schedule} runs each backward in two passes, which "
            "activation_checkpoint.selective_ac_option = 'op' forbids (one backward per recomputed region): use "
            "selective_ac_option = a number, mode = full, or another schedule"
        )
    if dims.pp > 1 and dims.ddp_enabled:
        raise ParallelError("DDP does not compose with pipeline parallel: use FSDP (data_parallel_shard_degree)")
    if dims.pp > 1:
        plan_pipeline(args.n_layers, p, cfg.training.local_batch_size)  # stages, schedule, microbatches
    if dims.ep > 1:
        if args.moe is None:
            raise ParallelError(
                f"expert_parallel_degree = {dims.ep} with a model without experts ({args.family} flavor "
                f"{cfg.model.flavor}): use an MoE family such as qwen3_moe, or expert_parallel_degree = 1"
            )
        if args.moe.num_experts % dims.ep:
            raise ParallelError(
                f"expert_parallel_degree = {dims.ep} does not divide the {args.moe.num_experts} experts of "
                f"{args.family} flavor {cfg.model.flavor}"
            )
    if dims.pp > 1 and args.tie_embeddings:
        raise ParallelError(
            f"pipeline_parallel_degree = {dims.pp} with a model whose output layer is its embedding "
            f"(tied, {args.family} flavor {cfg.model.flavor}): the two live on different stages; use an "
            "untied flavor, or FSDP/TP without pipelining"
        )
    check_float8(cfg, fsdp=dims.fsdp_enabled)
    check_lora(cfg)


def parallelize(model: nn.Module, cfg: JobConfig, dims: ParallelDims, sequence_parallel: bool = True) -> nn.Module:
    """Apply TP, AC, compile and data parallelism to one model part, in that order (``sequence_parallel``:
    apply_tp's)."""
    p = cfg.parallelism
    if dims.cp > 1 and p.context_parallel_method == "ulysses":  # linear-attention layers: a share of the heads
        enable_gated_deltanet_ulysses(model, dims.mesh["cp"])
    elif dims.cp > 1 and p.context_parallel_method == "ulysses_ring":  # a share of the heads, then the ring's scan
        enable_gated_deltanet_ulysses(model, dims.mesh["cp_ulysses"])
        enable_gated_deltanet_context_parallel(model, dims.mesh["cp_ring"])
    elif dims.cp > 1:  # linear-attention layers carry their state across the CP ranks' chunks
        enable_gated_deltanet_context_parallel(model, dims.mesh["cp"])
    if dims.cp > 1 and p.context_parallel_method == "ring":  # layers that fetch their neighbours' rows themselves
        enable_sequence_pieces(model, dims.mesh["cp"])
    if dims.tp > 1:
        apply_tp(
            model,
            dims.mesh["tp"],
            loss_parallel=not p.disable_loss_parallel,
            async_tp=p.enable_async_tensor_parallel,
            compiled=cfg.compile.enable,
            float8=communicates_float8(cfg.float8),
            sequence_parallel=sequence_parallel,
        )
    # The routed experts get their own mesh under EP, and under TP too (replicated there).
    experts_placed = model.args.moe is not None and (dims.ep > 1 or dims.tp > 1)
    if experts_placed:
        apply_ep(model, dims.expert_mesh[tuple(n for n, size in (("ep", dims.ep), ("tp", dims.tp)) if size > 1)])
    if cfg.lora.enable:
        freeze_base(model)  # TP and EP give replicated modules new Parameters, which require gradients
    if dims.cp > 1 and p.context_parallel_method == "ulysses":
        enable_ulysses(model, dims.mesh["cp"])
    elif dims.cp > 1 and p.context_parallel_method == "ulysses_ring":
        enable_ulysses_ring(model, dims.mesh["cp_ulysses"], dims.mesh["cp_ring"])
    apply_ac(model, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.fsdp_mesh(),
            param_dtype=getattr(torch, cfg.training.mixed_precision_param),
            reduce_dtype=getattr(torch, cfg.training.mixed_precision_reduce),
            reshard_after_forward=p.fsdp_reshard_after_forward,
            pipelined=dims.pp > 1,
            experts_mesh=dims.expert_fsdp_mesh() if experts_placed else None,
            experts_divide_factor=expert_gradient_divide_factor(dims.dp_replicate, dims.dp_shard, dims.cp),
        )
    elif dims.ddp_enabled:
        apply_ddp(model, dims.mesh["dp_replicate"], find_unused=spec_of(model.args).parameters_may_go_unused)
    return model


def build_model_parts(
    cfg: JobConfig,
    dims: ParallelDims,
    args: ModelArgs,
    device: torch.device,
    *,
    loss_fn: Callable | None = None,
    init: bool = True,
    fake_mode: contextlib.AbstractContextManager | None = None,
    sequence_parallel: bool = True,
) -> ModelParts:
    """Build on the meta device, parallelize, then materialize on ``device`` and initialize.

    ``fake_mode`` (a FakeTensorMode, with ``init=False``): materialize inside it, so the parts hold
    fake tensors with shapes but no storage (memory estimation).
    ``sequence_parallel=False``: tensor parallelism keeps activations whole between blocks (titanctl rl,
    whose sampler decodes one token per row; apply_tp).
    With ``init=False`` (the weights come from a checkpoint) LoRA adapters are still drawn: a base
    checkpoint has none, and a LoRA checkpoint loaded afterwards overwrites them.
    """
    check_layout(cfg, dims, args)
    with torch.device("meta"):
        model = build_model(args)
    float8 = None
    if cfg.float8.enable_float8_linear:
        float8 = convert_to_float8(model, cfg.float8, tp=dims.tp, device=torch.device(device))
    lora = apply_lora(model, cfg.lora) if cfg.lora.enable else None
    if torch.device(device).type == "cpu" and linear_kernel(cfg.training.cpu_linear) == "onednn":
        use_onednn_linears(model)  # the linears float8 left plain
    if dims.pp > 1:
        pipeline = build_pipeline(
            model,
            dims.mesh["pp"],
            cfg.parallelism,
            device=device,
            local_batch_size=cfg.training.local_batch_size,
            parallelize_fn=lambda stage: parallelize(stage, cfg, dims),
            loss_fn=loss_fn,
        )
        result = ModelParts(pipeline.model_parts, pipeline, float8, lora)
    else:
        result = ModelParts([parallelize(model, cfg, dims, sequence_parallel)], float8=float8, lora=lora)
    if float8 is not None and dims.tp > 1 and not communicates_float8(cfg.float8):
        float8.notes.append(
            f"float8 {cfg.float8.recipe_name} with tensor parallel: activations are all-gathered in high precision "
            "(torchao's float8 tensor-parallel styles are tensorwise)"
        )
    elif float8 is not None and dims.tp > 1 and not sends_float8(dims.mesh["tp"]):
        float8.notes.append(
            "float8 with tensor parallel on gloo: activations are all-gathered in high precision "
            "(gloo has no float8 dtypes; NCCL all-gathers them in float8)"
        )
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        for part in result.parts:
            part.to_empty(device=device)
            if init:
                initialize_weights(part, cfg.training.seed, buffer_device=device)
            elif lora is not None and fake_mode is None:
                initialize_weights(part, cfg.training.seed, buffer_device=device, adapters_only=True)
            part.train()
    return result
