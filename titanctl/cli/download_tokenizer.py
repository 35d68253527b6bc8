"""`titanctl download-tokenizer`."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.tools.download import DEFAULT_LOCAL_DIR, DEFAULT_REPO_ID  # plain constants: no heavy import


def download_tokenizer(
    repo_id: str = typer.Option(DEFAULT_REPO_ID, "--repo-id", help="Hugging Face repository."),
    tokenizer_path: str = typer.Option(
        "original", "--tokenizer-path", help="Folder of the file in the repo; empty for the top level."
    ),
    file: str | None = typer.Option(
        None,
        "--file",
        help="File to fetch. Default: tokenizer.model in a folder, tokenizer.json at the top level.",
    ),
    hf_token: str | None = typer.Option(
        None, "--hf-token", help="Token of an account with access (gated repos); default: env HF_TOKEN.",
        show_default=False,
    ),
    local_dir: Path = typer.Option(DEFAULT_LOCAL_DIR, "--local-dir", help="Where to save it."),
) -> None:
    """Fetch a Llama 3 tokenizer (tokenizer.model or tokenizer.json) from the Hugging Face Hub."""
    from titanctl.tools.download import download_tokenizer as fetch

    got = fetch(repo_id, tokenizer_path=tokenizer_path, filename=file, local_dir=local_dir, hf_token=hf_token,
                log=typer.echo)
    typer.echo(
        f"saved {got.path} (vocab {got.vocab_size}, sha256 {got.sha256[:12]}); "
        f"train with --model.tokenizer_path {got.path}"
    )
