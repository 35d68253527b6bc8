"""fp32 linear layers on CPU through oneDNN instead of torch's BLAS (MKL).

torch 2.13 multiplies fp32 matrices on CPU with MKL's sgemm, which on AMD CPUs avoids AVX-512:
on the debug model's linear shapes oneDNN was about twice as fast on an AMD EPYC with AVX-512
(``benchmarks/cpu_kernels.py``; ``benchmarks/train_throughput.py --linear aten`` shows the effect
on a whole step). bf16/fp16 matmuls already go to oneDNN inside torch, so only fp32 is rerouted.

The swap is a model converter, like float8's: it changes the class of plain ``nn.Linear``
modules in place (same ``weight`` parameter and name, same math: y = x W^T in fp32; results
differ from MKL's in the last bits, as two BLAS libraries do). At run time a converted layer
falls back to ``F.linear`` whenever oneDNN is not the right kernel: autocast on, a non-fp32
weight (FSDP mixed precision), a DTensor weight (tensor parallel), or a non-CPU device.

The kernel is a custom op, so that ``torch.compile`` calls it as an opaque kernel (inductor's own
lowering of ``mkldnn._linear_pointwise`` expects frozen inference weights) and fake tensors
(memory estimation) know its output shape.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanctl._torch_compat import ONEDNN_LINEAR, UNSAFE_VIEW


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and ONEDNN_LINEAR.problem() is None


def linear_kernel(setting: str) -> str:
    """The kernel ``training.cpu_linear`` picks: ``auto`` is oneDNN where it runs AVX-512 and MKL otherwise.

    On AVX2 code paths MKL's fp32 products win (train_throughput.py, 2 threads: 1.11x transformers with
    MKL, 1.00x with oneDNN); with AVX-512, oneDNN's win where MKL keeps to AVX2 (Zen 5: 1.63x against
    1.14x) and tie where it does not. The ISA is what torch runs (``ATEN_CPU_CAPABILITY`` caps it) and
    what oneDNN may use (``ONEDNN_MAX_CPU_ISA``), read at run time.
    """
    if setting != "auto":
        return setting
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" and (
        onednn_cap in ("ALL", "DEFAULT") or onednn_cap.startswith(("AVX512", "AVX10"))
    )
    return "onednn" if avx512 and onednn_available() else "aten"


@functools.cache
def _kernels():
    """oneDNN's linear and aten's non-view reshape, looked up once (not per call)."""
    return ONEDNN_LINEAR.get(), UNSAFE_VIEW.get()


@torch.library.custom_op("titanctl::onednn_mm_t", mutates_args=())
def onednn_mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T over a's last dim: a (..., K), b (N, K) -> (..., N), by oneDNN (any strides)."""
    linear, unsafe_view = _kernels()
    out = linear(a, b, None, "none", [], "")
    # For a 3-D+ ``a`` oneDNN returns a view of its 2-D result; like torch's linear, return a plain
    # tensor (FSDP warns about modules that return views).
    return unsafe_view(out, out.shape)


@onednn_mm_t.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(*a.shape[:-1], b.shape[0])


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = onednn_mm_t(grad, weight.t())  # (..., N) @ (N, K): dx = dy W
    if ctx.needs_input_grad[1]:
        # dW = dy^T x: (N, T) @ (T, K). oneDNN copies its first operand into rows, so the first is
        # the narrower of dy and x: dW itself, or dW^T = x^T dy transposed back (a weight-sized copy).
        dy, x = grad.flatten(0, -2), x.flatten(0, -2)  # (T, N), (T, K)
        if dy.shape[1] > x.shape[1]:
            grad_weight = onednn_mm_t(x.t(), dy.t()).t().contiguous()
        else:
            grad_weight = onednn_mm_t(dy.t(), x.t())
    return grad_x, grad_weight


onednn_mm_t.register_autograd(_backward, setup_context=_save_inputs)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose fp32 CPU products run in oneDNN; see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            self.bias is not None
            or isinstance(w, DTensor)
            or w.dtype != torch.float32
            or x.dtype != torch.float32
            or w.device.type != "cpu"
            or torch.is_autocast_enabled("cpu")
        ):
            return F.linear(x, w, self.bias)
        return onednn_mm_t(x, w)


def use_onednn_linears(model: nn.Module) -> int:
    """Turn every plain bias-free ``nn.Linear`` of ``model`` into a OneDNNLinear; returns how many.

    Subclasses (float8 linears) are left alone. Without oneDNN in this torch build, nothing changes.
    """
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            module.__class__ = OneDNNLinear
            count += 1
    return count
