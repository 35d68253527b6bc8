"""titanctl: pre-train Llama 3.1 models from one CPU to thousands of GPUs."""

import os as _os
import tempfile as _tempfile

__version__ = "0.1.0"


def _inductor_cache_per_cpu_capability() -> None:
    """Give each ``ATEN_CPU_CAPABILITY`` its own inductor cache, unless the user chose a cache.

    torch 2.13's inductor generates CPU kernels for the capability that variable selects, but its
    on-disk cache does not key them by it: a kernel compiled at AVX-512 and reused under
    ``ATEN_CPU_CAPABILITY=avx2`` returned wrong numbers (a compiled RMSNorm + softmax was off by
    0.84; the debug recipe's first loss was NaN).
    """
    capability = _os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in _os.environ:
        user = _os.environ.get("USER") or str(getattr(_os, "getuid", lambda: "user")())
        _os.environ["TORCHINDUCTOR_CACHE_DIR"] = _os.path.join(
            _tempfile.gettempdir(), f"torchinductor_{user}_{capability}"
        )


_inductor_cache_per_cpu_capability()
