"""`titanctl infer-tp`."""

from titanctl.cli.pending import not_yet


def infer_tp() -> None:
    """Generate text with a Tensor Parallel sharded model under torchrun."""
    raise not_yet("infer-tp", 6)
