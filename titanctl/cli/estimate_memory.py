"""`titanctl estimate-memory`."""

from titanctl.cli.pending import not_yet


def estimate_memory() -> None:
    """Per-rank peak memory of a recipe at a world size, without materializing the model."""
    raise not_yet("estimate-memory", 6)
