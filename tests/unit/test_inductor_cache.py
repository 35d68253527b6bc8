"""A kernel compiled for one ATEN_CPU_CAPABILITY is never reused under another (torch 2.13's
inductor cache does not tell them apart, and the reused kernel computed wrong numbers)."""

from __future__ import annotations

import os
import subprocess
import sys

COMPILED_VS_EAGER = """
import titanctl  # sets the cache folder before inductor is imported
import torch

def f(x, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).softmax(-1)

torch.manual_seed(0)
x, w = torch.randn(64, 256), torch.randn(256)
print((torch.compile(f)(x, w) - f(x, w)).abs().max().item())
"""


def test_each_cpu_capability_compiles_its_own_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)  # a cold default cache, shared by both runs
    errors = []
    # The CPU's own capability first (AVX-512 here), then AVX2 with the cache the first one warmed:
    # without a cache per capability the second run got 0.84 (and a compiled decode step aborted).
    for capability in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        out = subprocess.run([sys.executable, "-c", COMPILED_VS_EAGER], env={**env, **capability},
                             capture_output=True, text=True, timeout=300, check=True)
        errors.append(float(out.stdout.split()[-1]))
    assert max(errors) < 1e-5, errors
    assert any(p.name.startswith("torchinductor_") and p.name.endswith("_avx2") for p in tmp_path.iterdir())
