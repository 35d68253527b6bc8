"""One optimizer step's forward, loss and backward, for every layout.

The Trainer runs it on real tensors; ``titanctl estimate-memory`` runs the same code on fake ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from titanctl.config.job_config import JobConfig
from titanctl.parallel.layouts.context_parallel import context_parallel_ctx, document_context_parallel_ctx
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.sequence_pieces import holds_sequence_pieces
from titanctl.parallel.layouts.ulysses import ulysses_context_parallel_ctx
from titanctl.train.attention_masks import MicrobatchMasks, shapes_only
from titanctl.train.loss import IGNORE_INDEX, build_loss_fn, build_mean_loss_fn


@dataclasses.dataclass
class ForwardBackward:
    """Forward, loss and backward over one optimizer step's microbatches.

    The Trainer runs it on real tensors; `titanctl estimate-memory` runs the same code on fake ones.

    The loss is the mean over every counted token of the global batch (titanctl/train/loss.py): each
    microbatch adds its summed token losses divided by the step's ``loss_divisor``, the global count
    over the data-parallel x context-parallel ranks, whose gradients FSDP/DDP average. A microbatch is
    (inputs, labels) or, with chat data, (inputs, labels, positions): positions restart at 0 where a
    conversation begins; the attention mask and RoPE follow them.
    """

    cfg: JobConfig
    dims: ParallelDims
    model_parts: list[torch.nn.Module]
    pipeline: object | None  # titanctl.parallel.layouts.pipeline_parallel.Pipeline when pp > 1
    device: torch.device
    loss_fn: Callable | None = None  # default: build_loss_fn(cfg, tp), a sum over the counted tokens
    bos_id: int | None = None  # the tokenizer's: where documents start (model.attn_mask_type = block_causal)
    chat: bool = False  # chat data: microbatches carry positions, and their counted tokens vary

    def __post_init__(self):
        if self.loss_fn is None:
            self.loss_fn = build_loss_fn(self.cfg, self.dims.tp)
        self.mean_loss_fn = build_mean_loss_fn(self.cfg, self.dims.tp)
        self.attn_masks = MicrobatchMasks.build(self.cfg, self.dims, self.bos_id, self.model_parts,
                                                by_positions=self.chat)
        dp_mesh = self.dims.mesh_for("dp_replicate", "dp_shard") if self.dims.dp > 1 else None
        self._dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self._mtp_scale = 1.0
        # Multi-token prediction: its depths' mean loss over the step (scaled like the loss), for the logs.
        self.predicts_ahead = self.pipeline is None and self.model_parts[0].args.mtp_layers > 0
        self.mtp_loss_weight = self.cfg.model.mtp_loss_weight
        self.mtp_loss: torch.Tensor | None = None
        # Under CP: the step's attention work per CP rank (the keys its queries attend), for cp_imbalance.
        self.cp_work: torch.Tensor | None = None
        # Under ring CP, a model whose layers fetch their neighbours' rows themselves (sequence_pieces) gets its
        # tokens and labels cut head-tail, no mask and no ring.
        self.own_pieces = self.dims.cp > 1 and any(holds_sequence_pieces(part) for part in self.model_parts)
        compute_dtype = getattr(torch, self.cfg.training.mixed_precision_param)
        # FSDP casts the parameters itself (MixedPrecisionPolicy); other layouts autocast.
        self.autocast = (
            torch.autocast(self.device.type, dtype=compute_dtype)
            if compute_dtype != torch.float32 and not self.dims.fsdp_enabled
            else contextlib.nullcontext()
        )

    def train_context(self):
        """Loss parallel (logits stay sharded over tp) wraps forward, loss and backward."""
        p = self.cfg.parallelism
        if self.dims.tp > 1 and not p.disable_loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    def loss_divisor(self, counted: torch.Tensor) -> torch.Tensor:
        """The divisor of each microbatch's summed loss, from this rank's counted tokens (labels that are
        not IGNORE_INDEX) of the step: the global count / (dp x cp), so that the dp x cp ranks' losses
        average to the global mean. Chat data counts differ between ranks: an all-reduce over the
        data-parallel ranks (tensor, pipeline and context-parallel peers hold the same microbatches);
        text windows count every label, the same on every rank. Every rank calls it at the same steps."""
        if self._dp_group is not None:
            if self.chat:
                counted = counted.clone()
                dist.all_reduce(counted, group=self._dp_group)
            else:
                counted = counted * self.dims.dp
        return counted.clamp(min=1).float() / (self.dims.dp * self.dims.cp)

    def microbatch(
        self, inputs: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | float, *,
        positions: torch.Tensor | None = None, backward: bool = True,
    ) -> torch.Tensor | None:
        """The summed token losses of one microbatch / ``divisor``, after its backward; None off the last
        stage. ``backward=False``: forward and loss only, under torch.no_grad (validation)."""
        # Which positions each CP rank holds, chosen from the whole microbatch's masks (None: head-tail, or no
        # order: no CP, Ulysses); the masks, the cut of tokens, labels and RoPE, and the ring's key columns follow it.
        order = self.attn_masks.cp_order(inputs, positions)
        if self.dims.cp > 1 and backward and not shapes_only(inputs):  # training steps, not validation's windows
            work = self.attn_masks.rank_work(inputs, positions, order)
            self.cp_work = work if self.cp_work is None else self.cp_work + work
        attn_mask = self.attn_masks(inputs, positions, order)  # from the whole microbatch, before any sharding
        model_kwargs = {} if attn_mask is None else {"attn_mask": attn_mask}
        if positions is not None:
            model_kwargs["positions"] = positions
        with self.train_context():
            if self.pipeline is not None:
                with self.pipelined_cp_ctx(inputs, labels), self.autocast:
                    if backward:
                        loss = self.pipeline.step(inputs, labels, loss_divisor=divisor, **model_kwargs)
                    else:
                        loss = self.pipeline.eval_loss(inputs, labels, loss_divisor=divisor, **model_kwargs)
                return None if loss is None else loss.detach()
            cp_ctx = contextlib.nullcontext()
            if self.dims.cp > 1 and self.cfg.parallelism.context_parallel_method == "ulysses":
                cp_ctx = self.ulysses_ctx(inputs, labels, positions)
            elif self.own_pieces:
                cp_ctx = document_context_parallel_ctx(self.dims.mesh["cp"], buffers=[inputs, labels], seq_dims=[1, 1],
                                                       no_restore={inputs, labels})
            elif self.dims.cp > 1 and attn_mask is not None:
                # With positions the model looks its RoPE rows up by them: they are cut like the tokens,
                # and the table stays whole.
                sharded = [inputs, labels, positions] if positions is not None else [inputs, labels]
                cp_ctx = document_context_parallel_ctx(
                    self.dims.mesh["cp"],
                    buffers=sharded if positions is not None else [*sharded, self.model_parts[0].rope_cache],
                    seq_dims=[1, 1, 1] if positions is not None else [1, 1, 0],
                    no_restore=set(sharded),
                    order=order,
                )
            elif self.dims.cp > 1:
                model = self.model_parts[0]
                cp_ctx = context_parallel_ctx(
                    self.dims.mesh["cp"],
                    buffers=[inputs, labels, model.rope_cache],
                    seq_dims=[1, 1, 0],
                    no_restore={inputs, labels},
                    rotate_method=self.cfg.parallelism.context_parallel_rotate_method,
                )
            with cp_ctx:
                predict_ahead = backward and self.predicts_ahead
                with self.autocast:
                    out = self.model_parts[0](inputs, mtp=predict_ahead, **model_kwargs)
                logits, depth_logits = out if predict_ahead else (out, [])
                loss = self.loss_fn(logits, labels) / divisor
                objective = loss
                if depth_logits:  # the mean of the microbatches' means over the depths
                    mtp_loss = self.multi_token_loss(depth_logits, labels) * self._mtp_scale
                    self.mtp_loss = mtp_loss.detach() if self.mtp_loss is None else self.mtp_loss + mtp_loss.detach()
                    objective = loss + self.mtp_loss_weight * mtp_loss
                if backward:
                    objective.backward()
            return loss.detach()

    def pipelined_cp_ctx(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Ring CP inside pipeline stages (causal masks; build.check_pipelined_cp): the batch is cut by sequence
        before the schedule splits it into microbatches by rows, and each stage's RoPE table with it."""
        if self.dims.cp == 1:
            return contextlib.nullcontext()
        tables = [part.rope_cache for part in self.model_parts]
        return context_parallel_ctx(self.dims.mesh["cp"], buffers=[inputs, labels, *tables],
                                    seq_dims=[1, 1, *(0 for _ in tables)], no_restore={inputs, labels},
                                    rotate_method=self.cfg.parallelism.context_parallel_rotate_method)

    def ulysses_ctx(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None):
        """Ulysses CP: tokens, labels and the RoPE table (or, with positions, those) cut to this rank's
        contiguous share; attention's all-to-alls give its kernels the whole sequence."""
        sharded = [inputs, labels] if positions is None else [inputs, labels, positions]
        buffers = sharded if positions is not None else [*sharded, self.model_parts[0].rope_cache]
        return ulysses_context_parallel_ctx(self.dims.mesh["cp"], buffers=buffers,
                                            seq_dims=[1, 1, 1] if positions is not None else [1, 1, 0],
                                            no_restore=set(sharded))

    def multi_token_loss(self, depth_logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """The mean over depths of each depth's mean cross-entropy: depth k at position i predicts the
        token labels[i + k] (k + 1 after the input's), and its last k positions predict nothing."""
        total = 0.0
        for k, logits in enumerate(depth_logits, start=1):
            ahead = torch.cat([labels[:, k:], labels.new_full((labels.shape[0], k), IGNORE_INDEX)], dim=1)
            total = total + self.mean_loss_fn(logits, ahead)
        return total / len(depth_logits)

    def __call__(self, microbatches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """Accumulate the gradients of the step's mean loss; returns this rank's share of it (None off
        the last stage): the sum over the dp x cp ranks, / (dp x cp), is the step's loss."""
        microbatches = [tuple(t.to(self.device) for t in mb) for mb in microbatches]
        counted = sum((labels != IGNORE_INDEX).sum() for _, labels, *_ in microbatches)
        divisor = self.loss_divisor(counted)
        self._mtp_scale = 1.0 / len(microbatches)
        loss_sum = None
        self.mtp_loss = None
        self.cp_work = None
        for inputs, labels, *positions in microbatches:
            loss = self.microbatch(inputs, labels, divisor, positions=positions[0] if positions else None)
            if loss is not None:
                loss_sum = loss if loss_sum is None else loss_sum + loss
        return loss_sum
