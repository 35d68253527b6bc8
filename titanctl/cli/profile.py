"""`titanctl profile`."""

from titanctl.cli.pending import not_yet


def profile() -> None:
    """Capture profiler traces and memory timelines of a few training steps."""
    raise not_yet("profile", 6)
