"""Where tokenized datasets are cached: ~/.cache/titanctl, or TITANCTL_CACHE_DIR (empty: no cache)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path | None:
    """Where tokenized datasets are cached; None when TITANCTL_CACHE_DIR is set but empty."""
    env = os.environ.get("TITANCTL_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env else None
    return Path.home() / ".cache" / "titanctl"
