"""`titanctl inspect-trace`."""

from titanctl.cli.pending import not_yet


def inspect_trace() -> None:
    """Read profiler traces and Flight Recorder dumps: what is slow, which rank hangs."""
    raise not_yet("inspect-trace", 6)
