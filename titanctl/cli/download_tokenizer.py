"""`titanctl download-tokenizer`."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.data.download import DEFAULT_LOCAL_DIR, DEFAULT_REPO_ID  # plain constants: no heavy import


def download_tokenizer(
    model: str | None = typer.Option(
        None, "--model", help="A model family (llama3, qwen3): fetch its tokenizer from its usual repository.",
        show_default=False,
    ),
    repo_id: str | None = typer.Option(
        None, "--repo-id", help=f"Hugging Face repository (default: the family's; {DEFAULT_REPO_ID} without --model).",
        show_default=False,
    ),
    tokenizer_path: str | None = typer.Option(
        None, "--tokenizer-path", help="Folder of the file in the repo; empty for the top level "
        "(default: the family's; 'original' without --model).", show_default=False,
    ),
    file: str | None = typer.Option(
        None,
        "--file",
        help="File to fetch. Default: tokenizer.model in a folder, tokenizer.json at the top level "
        "(with the tokenizer_config.json beside it).",
    ),
    hf_token: str | None = typer.Option(
        None, "--hf-token", help="Token of an account with access (gated repos); default: env HF_TOKEN.",
        show_default=False,
    ),
    local_dir: Path = typer.Option(DEFAULT_LOCAL_DIR, "--local-dir", help="Where to save it."),
) -> None:
    """Fetch a tokenizer from the Hugging Face Hub: Llama 3's tokenizer.model, or a byte-level BPE
    tokenizer.json (Llama 3's, Qwen3's: --tokenizer-path "") with its tokenizer_config.json."""
    from titanctl.data.download import download_tokenizer as fetch

    usual_repo, usual_path = DEFAULT_REPO_ID, "original"
    if model is not None:
        from titanctl.models.registry import get_spec

        usual_repo, usual_path = get_spec(model).tokenizer_repo
    repo_id = usual_repo if repo_id is None else repo_id
    tokenizer_path = usual_path if tokenizer_path is None else tokenizer_path
    got = fetch(repo_id, tokenizer_path=tokenizer_path, filename=file, local_dir=local_dir, hf_token=hf_token,
                log=typer.echo)
    beside = f" and {got.config}" if got.config else ""
    typer.echo(
        f"saved {got.path}{beside} (vocab {got.vocab_size}, sha256 {got.sha256[:12]}); "
        f"train with --model.tokenizer_path {got.path}"
    )
