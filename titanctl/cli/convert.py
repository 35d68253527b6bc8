"""`titanctl convert-checkpoint`."""

from titanctl.cli.pending import not_yet


def convert() -> None:
    """Convert checkpoints between Meta, DCP, Hugging Face and torchtune formats."""
    raise not_yet("convert-checkpoint", 5)
