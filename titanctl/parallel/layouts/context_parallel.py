"""Context parallelism: the sequence is sharded across ranks and attention runs as a ring.

Built on ``torch.distributed.tensor.experimental.context_parallel`` (PyTorch 2.13), which
while active (1) shards the given buffers in place along their sequence dims, reordered
head-and-tail so that causal attention costs every rank the same, and (2) patches
``F.scaled_dot_product_attention`` to wrap q, k, v as DTensors sharded on the sequence
dim (2), whose SDPA op DTensor then hands to a ring-attention handler.

Why ``enable_cpu_ring_attention`` exists
----------------------------------------
torch's ring attention is routed per aten op. While CP is on,
``_enable_cp_dtensor_dispatcher`` merges the module table
``_context_parallel._attention.custom_ops`` into ``DTensor._op_dispatcher._custom_op_handlers``;
that table names only the CUDA kernels (``_scaled_dot_product_{flash,efficient,cudnn}_attention``
and their ``_backward``). On CPU, SDPA lowers to
``aten._scaled_dot_product_flash_attention_for_cpu`` (backward: ``..._for_cpu_backward``),
which is in that table nowhere, and DTensor has no sharding strategy for it either, so CP on
CPU fails with "... does not have a sharding strategy registered". Forcing the math backend
does not help (measured: it decomposes into ops that mix Tensor and DTensor).
The algorithm itself is device-agnostic: ``_templated_ring_attention[_backward]`` take the
attention op as an argument and only need it to return ``(out, logsumexp, ...)`` /
``(grad_q, grad_k, grad_v, ...)``, which the CPU ops do. So we add the two CPU ops to the
same table with a handler that calls those templates with the CPU ops. It is a dispatch-table
gap, not a missing algorithm.

Our handler differs from torch's ``_sdpa_handler`` in one way: it does not ask DTensor's
sharding propagator for the output placements (that would need a Shard(2) strategy for the CPU
ops registered into DTensor's global table, where it would also apply outside CP and compute
per-shard attention silently). It checks that q, k, v (and the backward's tensors) are all
``Shard(2)`` on the CP mesh and returns ``Shard(2)`` outputs, which is exactly what torch's CP
strategies for the CUDA ops prescribe. Because the entries live in ``custom_ops``, they are
active only while torch's CP dispatcher is (inside ``context_parallel``), like the CUDA ones.

Signature differences handled (check with ``torch.ops.aten.<op>.default._schema``):
  CUDA flash fwd (q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
      -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask)
  CPU  flash fwd (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, lse)
  CUDA flash bwd (grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, philox_seed, philox_offset, *, scale) -> (dq, dk, dv)
  CPU  flash bwd (grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale)
      -> (dq, dk, dv)
The CPU lse is (B, H, T) like CUDA's, so torch's merger and backward chunking apply unchanged.

Under a mask (``model.attn_mask_type = "block_causal"``; gpt-oss's sliding windows and sinks) torch's ring
attention does not apply (it takes no mask): ``document_context_parallel_ctx`` and
``enable_document_context_parallel`` at the end of this file shard the sequence the same way and route the
masked calls through our own ring (``masked_ring``), which skips the blocks the mask leaves empty.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import context_parallel

from titanctl import _torch_compat
from titanctl.errors import ParallelError
from titanctl.parallel.layouts.masked_ring import enable_masked_ring

SEQ_DIM = 2  # of q, k, v inside SDPA: (B, H, T, head_dim)
ROTATE_METHODS = ("allgather", "alltoall")

_FWD_ARGS = ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
_BWD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
             "attn_mask", "scale"]  # fmt: skip
_RING_FWD_PARAMS = ["group", "seq_dim", "op", "query", "key", "value", "is_causal"]
_RING_BWD_PARAMS = ["group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key",
                    "value", "out", "logsumexp", "is_causal"]  # fmt: skip


def check_cp_divisibility(seq_len: int, cp: int) -> None:
    """Context parallel needs ``seq_len`` divisible by ``2 * cp``.

    torch 2.13 cuts the sequence into ``2 * cp`` chunks and gives rank r chunks r and
    2cp-1-r (``_HeadTailLoadBalancer``), so causal attention costs each rank the same. If
    ``seq_len % (2 * cp) != 0`` it silently drops the load balancing (``_create_default_
    load_balancer`` returns None; the last rank then does up to twice the average work), and
    if ``seq_len % cp != 0`` the shards are uneven and the ring exchange, which assumes equal
    shards, breaks. We require the balanced case.
    """
    if cp < 1:
        raise ParallelError(f"context parallel degree must be >= 1, got {cp}")
    if cp > 1 and seq_len % (2 * cp):
        raise ParallelError(
            f"context parallel needs seq_len divisible by 2 x cp = {2 * cp} (load-balanced "
            f"chunks), but seq_len is {seq_len}"
        )


def _require(cond: bool, what: str) -> None:
    _torch_compat.require(cond, "context parallel on CPU", what)


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "kwargs"]


def _seq_sharded_spec(local: Tensor, mesh):
    """The DTensorSpec of a tensor whose local piece is ``local``, sharded on SEQ_DIM."""
    placements = (Shard(SEQ_DIM),)
    shape, stride = _torch_compat.COMPUTE_GLOBAL_TENSOR_INFO.get()(local, mesh, placements)
    meta = _torch_compat.TENSOR_META.get()(torch.Size(shape), tuple(stride), local.dtype)
    return _torch_compat.DTENSOR_SPEC.get()(mesh, placements, tensor_meta=meta)


def _make_cpu_ring_handler():
    """The DTensor custom-op handler for the CPU flash SDPA op and its backward."""
    dtensor_spec = _torch_compat.DTENSOR_SPEC.get()
    dispatcher = _torch_compat.DTENSOR_OP_DISPATCHER.get()
    fwd_op, bwd_op = _torch_compat.CPU_FLASH_SDPA.get(), _torch_compat.CPU_FLASH_SDPA_BACKWARD.get()
    ring_fwd, ring_bwd = _torch_compat.CP_RING_FORWARD.get(), _torch_compat.CP_RING_BACKWARD.get()

    def ring_forward(group, query, key, value, dropout_p=0.0, is_causal=False, *,
                     attn_mask=None, scale=None):  # fmt: skip
        if attn_mask is not None or dropout_p != 0.0:
            raise NotImplementedError("CPU ring attention supports neither attn_mask nor dropout")
        return ring_fwd(group, SEQ_DIM, fwd_op, query=query, key=key, value=value,
                        is_causal=is_causal, dropout_p=dropout_p, scale=scale)  # fmt: skip

    def ring_backward(group, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                      *, attn_mask=None, scale=None):  # fmt: skip
        if attn_mask is not None or dropout_p != 0.0:
            raise NotImplementedError("CPU ring attention supports neither attn_mask nor dropout")
        return ring_bwd(group, SEQ_DIM, bwd_op, grad_out=grad_out, grad_out_name="grad_out",
                        query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                        is_causal=is_causal, dropout_p=dropout_p, scale=scale)  # fmt: skip

    def handler(op_call, args, kwargs):
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        mesh = op_info.compute_mesh
        kwargs_schema = op_info.schema.kwargs_schema.values() if op_info.schema else ()
        for spec in (*op_info.flat_args_schema, *kwargs_schema):
            if not isinstance(spec, dtensor_spec):
                continue
            if spec.mesh != mesh or tuple(spec.placements) != (Shard(SEQ_DIM),):
                raise NotImplementedError(
                    f"CPU ring attention needs every tensor of {op_call} sharded Shard({SEQ_DIM}) "
                    f"on the 1-D CP mesh, got {spec.placements} on {spec.mesh}"
                )
        if mesh.ndim != 1:
            raise NotImplementedError("CPU ring attention needs a 1-D CP mesh")
        run = ring_forward if op_call == fwd_op else ring_backward
        local_results = run(mesh.get_group(), *op_info.local_args, **op_info.local_kwargs)
        out_specs = tuple(_seq_sharded_spec(t, mesh) for t in local_results)
        return dispatcher.wrap(tuple(local_results), out_specs)

    return {fwd_op: handler, bwd_op: handler}


def enable_cpu_ring_attention() -> None:
    """Route the CPU flash SDPA op (and its backward) through torch's ring attention under CP.

    Idempotent; a no-op if torch already routes the CPU op itself. Takes effect only
    inside ``context_parallel`` (see the module docstring). Raises TorchInternalsError if the
    torch internals this relies on are missing or changed.
    """
    table = _torch_compat.CP_CUSTOM_OPS.get()
    _torch_compat.CP_ENABLE_DISPATCHER.check()
    _require(isinstance(table, dict), "the CP custom_ops table is no longer a dict")
    fwd_op, bwd_op = _torch_compat.CPU_FLASH_SDPA.get(), _torch_compat.CPU_FLASH_SDPA_BACKWARD.get()
    if fwd_op in table and bwd_op in table:
        return  # already ours, or a torch that routes the CPU op itself
    fwd_schema, bwd_schema = _torch_compat.op_schema(fwd_op), _torch_compat.op_schema(bwd_op)
    _require([a.name for a in fwd_schema.arguments] == _FWD_ARGS, f"schema of {fwd_op} changed: {fwd_schema}")
    _require([a.name for a in bwd_schema.arguments] == _BWD_ARGS, f"schema of {bwd_op} changed: {bwd_schema}")
    _require(
        _params(_torch_compat.CP_RING_FORWARD.get()) == _RING_FWD_PARAMS,
        "signature of _templated_ring_attention changed",
    )
    _require(
        _params(_torch_compat.CP_RING_BACKWARD.get()) == _RING_BWD_PARAMS,
        "signature of _templated_ring_attention_backward changed",
    )
    table.update(_make_cpu_ring_handler())


def _set_rotate_method(rotate_method: str) -> None:
    if rotate_method not in ROTATE_METHODS:
        raise ParallelError(
            f"unknown context parallel rotate method {rotate_method!r}; "
            f"choose one of {', '.join(ROTATE_METHODS)}"
        )
    _torch_compat.CP_SET_ROTATE_METHOD.get()(rotate_method)


@contextlib.contextmanager
def context_parallel_ctx(
    cp_mesh,
    *,
    buffers: list[Tensor],
    seq_dims: list[int],
    no_restore: set[Tensor],
    rotate_method: str = "allgather",
) -> Iterator[None]:
    """Run the body with the sequence sharded over ``cp_mesh`` (1-D) and ring attention on.

    ``buffers`` are sharded in place along ``seq_dims`` (typically ``[inputs, labels,
    model.rope_cache]`` with ``[1, 1, 0]``) and restored on exit, except those in
    ``no_restore``. Every buffer must have the same length along its sequence dim: the RoPE
    table is sharded like the tokens, so build the model with ``max_seq_len == seq_len``
    (or give it a ``rope_cache`` cut to ``seq_len``). Forward and backward both belong inside.
    The rotate method (``allgather`` or ``alltoall``) is a process-wide torch setting; it is
    set on every entry.
    """
    _check_buffers(cp_mesh, buffers, seq_dims)
    _set_rotate_method(rotate_method)
    if cp_mesh.device_type == "cpu":
        enable_cpu_ring_attention()
    with context_parallel(
        cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore
    ):
        yield


# --- context parallel under a mask (model.attn_mask_type = "block_causal"; sliding windows, sinks) --------------
#
# Ring attention, torch's CUDA handlers and the CPU one above alike, takes no mask, and torch's
# FlexAttention route (``_create_cp_block_mask``) needs seq_len divisible by cp x 128 and has no CPU
# backward in 2.13. So under a mask each rank keeps its load-balanced share of the queries and attends
# them, with the mask of (its queries, all keys) that the step builds from the whole microbatch, to the
# other ranks' keys and values one shard at a time (``masked_ring``): the blocks that mask leaves empty
# are neither computed nor sent, and a rank holds at most two K/V shards, O(S / cp).


def load_balanced_order(seq_len: int, cp: int) -> Tensor:
    """(seq_len,) positions in the order the CP ranks hold them: the sequence cut into 2 x cp
    chunks, rank r holding chunks r and 2cp-1-r (torch's head-tail balancing), so that causal and
    block-causal work (which grows along the sequence) costs every rank about the same."""
    check_cp_divisibility(seq_len, cp)
    chunks = torch.arange(seq_len).view(2 * cp, -1)  # (2cp, seq_len / 2cp)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def document_cp_positions(seq_len: int, cp_mesh, order: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(this rank's query positions (seq_len / cp,), the gathered keys' positions (seq_len,)) in the
    window, for a document mask under ``document_context_parallel_ctx``. ``order``: every position in the
    order the ranks hold them (rank r the r-th slice of seq_len / cp; titanctl/parallel/layouts/cp_balance.py
    chooses it per microbatch); default head-tail (``load_balanced_order``)."""
    if order is None:
        order = load_balanced_order(seq_len, cp_mesh.size())
    return order.view(cp_mesh.size(), -1)[cp_mesh.get_local_rank()], order


def enable_document_context_parallel(model: torch.nn.Module, cp_mesh) -> None:
    """Make every attention kernel of ``model`` run the masked ring over ``cp_mesh`` when it is given a mask
    (idempotent). Causal calls (no mask) are left to torch's ring attention."""
    enable_masked_ring(model, cp_mesh)


def _check_buffers(cp_mesh, buffers: list[Tensor], seq_dims: list[int]) -> int:
    """The common sequence length of ``buffers`` along ``seq_dims``, checked."""
    if cp_mesh.ndim != 1:
        raise ParallelError(f"context parallel needs a 1-D mesh, got {cp_mesh.ndim} dims")
    if len(buffers) != len(seq_dims) or not buffers:
        raise ParallelError(
            f"context parallel got {len(buffers)} buffers but {len(seq_dims)} sequence dims"
        )
    seq_len = buffers[0].shape[seq_dims[0]]
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims)):
        if buf.shape[dim] != seq_len:
            raise ParallelError(
                f"context parallel buffer {i} has length {buf.shape[dim]} along dim {dim}, but the "
                f"inputs have seq_len {seq_len}: build the model with max_seq_len == seq_len"
            )
    check_cp_divisibility(seq_len, cp_mesh.size())
    return seq_len


@contextlib.contextmanager
def document_context_parallel_ctx(
    cp_mesh, *, buffers: list[Tensor], seq_dims: list[int], no_restore: set[Tensor], order: Tensor | None = None
) -> Iterator[None]:
    """``context_parallel_ctx`` for a model given a document mask: the buffers are cut in place to
    this rank's positions (``document_cp_positions``, of ``order``) and restored on exit (except
    ``no_restore``); attention needs ``enable_document_context_parallel`` and the mask of those positions."""
    seq_len = _check_buffers(cp_mesh, buffers, seq_dims)
    mine, _ = document_cp_positions(seq_len, cp_mesh, order)
    with buffers_cut_in_place(buffers, seq_dims, no_restore, mine):
        yield


@contextlib.contextmanager
def buffers_cut_in_place(buffers: list[Tensor], seq_dims: list[int], no_restore: set[Tensor],
                         positions: Tensor) -> Iterator[None]:
    """Each buffer cut in place to ``positions`` along its sequence dim, restored on exit (except
    ``no_restore``): the model's own tensors (the RoPE table) keep their identity."""
    originals = []
    with torch.no_grad():
        for buf, dim in zip(buffers, seq_dims):
            originals.append(None if any(buf is b for b in no_restore) else buf.clone())
            shard = buf.index_select(dim, positions.to(buf.device))
            buf.resize_(shard.shape)
            buf.copy_(shard)
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, original in zip(buffers, originals):
                if original is not None:
                    buf.resize_(original.shape)
                    buf.copy_(original)
