"""Fetch a tokenizer from the Hugging Face Hub (``huggingface_hub.hf_hub_download``).

Meta's repositories keep the tiktoken ``tokenizer.model`` in ``original/`` and a
``tokenizer.json`` (the same BPE for ``tokenizers``) at the top: both load in
``titanctl.data.tokenizer.Tokenizer``. Gated repositories (all of meta-llama) need a
token of an account that accepted the licence: ``--hf-token`` or ``HF_TOKEN``. The token
is handed to huggingface_hub only; it is never printed, and it is scrubbed from any
error message before that message is shown.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from titanctl.errors import DataError

DEFAULT_LOCAL_DIR = Path("assets/tokenizer")


@dataclass
class Downloaded:
    path: Path
    vocab_size: int
    sha256: str


def repo_file(tokenizer_path: str, filename: str | None) -> str:
    """The file's path inside the repo: `original/tokenizer.model`, or `tokenizer.json` at the top.

    Without --file, a folder (e.g. Meta's `original`) means its tiktoken `tokenizer.model`,
    and an empty folder means the repo's top-level `tokenizer.json`.
    """
    folder = tokenizer_path.strip("/")
    name = filename or ("tokenizer.model" if folder else "tokenizer.json")
    return f"{folder}/{name}" if folder else name


def _scrub(text: str, token: str | None) -> str:
    text = " ".join(str(text).split())  # one line
    return text.replace(token, "***") if token else text


def download_tokenizer(
    repo_id: str,
    *,
    tokenizer_path: str = "original",
    filename: str | None = None,
    local_dir: str | os.PathLike = DEFAULT_LOCAL_DIR,
    hf_token: str | None = None,
) -> Downloaded:
    """Download one tokenizer file into `local_dir` (keeping the repo's sub-folders) and check it loads."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = hf_token or os.environ.get("HF_TOKEN") or None
    target = repo_file(tokenizer_path, filename)
    where = f"{target} of {repo_id}"
    try:
        path = Path(hf_hub_download(repo_id=repo_id, filename=target, local_dir=local_dir, token=token))
    except GatedRepoError:
        raise DataError(
            f"{repo_id} is gated: accept its licence on the Hub with your account, then pass a token of that "
            "account with --hf-token or HF_TOKEN" + ("" if token else " (no token was given)")
        ) from None
    except RepositoryNotFoundError:
        raise DataError(
            f"repository {repo_id} not found, or it is private and "
            + ("the token has no access to it" if token else "no token was given (--hf-token or HF_TOKEN)")
        ) from None
    except RevisionNotFoundError as e:
        raise DataError(f"cannot download {where}: {_scrub(e, token)}") from None
    except LocalEntryNotFoundError:
        if constants.is_offline_mode():
            raise DataError(
                f"cannot download {where}: HF_HUB_OFFLINE is set (offline mode) and the file is not in "
                f"{local_dir}; unset HF_HUB_OFFLINE, or copy the file there"
            ) from None
        raise DataError(
            f"cannot download {where}: the Hugging Face Hub ({constants.ENDPOINT}) is unreachable and the file "
            f"is not in {local_dir}"
        ) from None
    except EntryNotFoundError:
        hint = "; Meta's repos keep tokenizer.model in 'original'" if not tokenizer_path else ""
        raise DataError(f"{repo_id} has no file {target}{hint}") from None
    except HfHubHTTPError as e:
        raise DataError(f"cannot download {where}: {_scrub(e, token)}") from None
    except (OSError, ValueError) as e:  # a local_dir that cannot be written, a malformed repo id
        raise DataError(f"cannot download {where}: {_scrub(e, token)}") from None

    from titanctl.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)  # a DataError names the file if it is not a usable tokenizer
    return Downloaded(path=path, vocab_size=tokenizer.vocab_size, sha256=tokenizer.sha256)
