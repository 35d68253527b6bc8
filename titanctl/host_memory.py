"""How much memory this host can still hand out, for refusing work that would not fit before it starts."""

from __future__ import annotations

from pathlib import Path


def available_bytes() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable`` of /proc/meminfo: free
    memory plus the page cache it can drop); None where it does not say (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
