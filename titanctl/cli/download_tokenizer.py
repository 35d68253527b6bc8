"""`titanctl download-tokenizer`."""

from titanctl.cli.pending import not_yet


def download_tokenizer() -> None:
    """Fetch a tokenizer from the Hugging Face hub."""
    raise not_yet("download-tokenizer", 5)
