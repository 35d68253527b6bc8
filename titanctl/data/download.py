"""Fetch a tokenizer from the Hugging Face Hub (``huggingface_hub.hf_hub_download``).

Meta's repositories keep the tiktoken ``tokenizer.model`` in ``original/`` and a
``tokenizer.json`` (the same BPE for ``tokenizers``) at the top: both load in
``titanctl.data.tokenizer.Tokenizer``. Other Hugging Face repositories (Qwen's) have only
the ``tokenizer.json``, whose special tokens their ``tokenizer_config.json`` names: a
``tokenizer.json`` is fetched with the ``tokenizer_config.json`` beside it, when the repo
has one. Gated repositories (all of meta-llama) need a
token of an account that accepted the licence: ``--hf-token`` or ``HF_TOKEN``. The token
is handed to huggingface_hub only; it is never printed, and it is scrubbed from any
error message before that message is shown.
"""

from __future__ import annotations

import os
import socket
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from titanctl.data.tokenizer import TOKENIZER_CONFIG, Tokenizer
from titanctl.errors import DataError

DEFAULT_LOCAL_DIR = Path("assets/tokenizer")
DEFAULT_REPO_ID = "meta-llama/Llama-3.1-8B"  # the id the README and docs/checkpoints.md use
PROBE_TIMEOUT_S = 5.0  # a reachable Hub answers a TCP connect in well under a second


@dataclass
class Downloaded:
    path: Path
    vocab_size: int
    sha256: str
    config: Path | None = None  # the tokenizer_config.json fetched beside a tokenizer.json


def repo_file(tokenizer_path: str, filename: str | None) -> str:
    """The file's path inside the repo: `original/tokenizer.model`, or `tokenizer.json` at the top.

    Without --file, a folder (e.g. Meta's `original`) means its tiktoken `tokenizer.model`,
    and an empty folder means the repo's top-level `tokenizer.json`.
    """
    folder = tokenizer_path.strip("/")
    name = filename or ("tokenizer.model" if folder else "tokenizer.json")
    return f"{folder}/{name}" if folder else name


def _connect_target(endpoint: str) -> tuple[str, int]:
    """The (host, port) a request to ``endpoint`` first connects to: the proxy that the environment
    names for it (HTTPS_PROXY, ..., minus NO_PROXY), else the endpoint itself."""
    url = urlsplit(endpoint)
    host = url.hostname or ""
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host = url.hostname or ""
    return host, url.port or (443 if url.scheme == "https" else 80)


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the Hub (or its proxy) opens, else why not: one connect
    instead of huggingface_hub's five retries with back-off (~23 s) before it gives up."""
    host, port = _connect_target(endpoint)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror as e:
        return f"cannot resolve {host} ({e.strerror or e})"
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e})"
    return None


def _scrub(text: str, token: str | None) -> str:
    text = " ".join(str(text).split())  # one line
    return text.replace(token, "***") if token else text


def config_file(target: str) -> str | None:
    """The repo's `tokenizer_config.json` beside `target` when that is a `tokenizer.json`, else None."""
    folder, _, name = target.rpartition("/")
    if name != "tokenizer.json":
        return None
    return f"{folder}/{TOKENIZER_CONFIG}" if folder else TOKENIZER_CONFIG


def _hub_download(
    repo_id: str, target: str, local_dir, hf_token: str | None, tokenizer_path: str, optional: bool = False
) -> Path | None:
    """huggingface_hub's download, its refusals turned into one-line DataErrors without the token.
    An `optional` file the repo lacks (or that offline mode does not find in `local_dir`) is None."""
    # huggingface_hub (and its HTTP stack) loads only when the hub is asked
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
    where = f"{target} of {repo_id}"
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=target, local_dir=local_dir, token=token))
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
        if optional:
            return None
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
        if optional:
            return None
        hint = "; Meta's repos keep tokenizer.model in 'original'" if not tokenizer_path else ""
        raise DataError(f"{repo_id} has no file {target}{hint}") from None
    except HfHubHTTPError as e:
        raise DataError(f"cannot download {where}: {_scrub(e, token)}") from None
    except (OSError, ValueError) as e:  # a local_dir that cannot be written, a malformed repo id
        raise DataError(f"cannot download {where}: {_scrub(e, token)}") from None


def download_tokenizer(
    repo_id: str,
    *,
    tokenizer_path: str = "original",
    filename: str | None = None,
    local_dir: str | os.PathLike = DEFAULT_LOCAL_DIR,
    hf_token: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Downloaded:
    """Download one tokenizer file into `local_dir` (keeping the repo's sub-folders), with the
    `tokenizer_config.json` beside a `tokenizer.json`, and check that it loads.

    Online, ``log`` first hears which endpoint is contacted for which file. A Hub that cannot be
    reached fails at once, without touching `local_dir`, unless the file is already there (used as
    it is, as offline mode would).
    """
    from huggingface_hub import constants  # (see _hub_download)

    target = repo_file(tokenizer_path, filename)
    where = f"{target} of {repo_id}"
    unreachable = None
    if not constants.is_offline_mode():
        if log is not None:
            log(f"contacting {constants.ENDPOINT} for {where}")
        unreachable = probe(constants.ENDPOINT)

    def fetch(name: str, optional: bool = False) -> Path | None:
        if unreachable is None:  # online, or offline mode (which looks in local_dir)
            return _hub_download(repo_id, name, local_dir, hf_token, tokenizer_path, optional)
        local = Path(local_dir) / name
        if local.is_file():
            if log is not None:
                log(f"the Hub is unreachable ({unreachable}); using {local} as it is")
            return local
        if optional:
            return None
        raise DataError(
            f"cannot download {where}: the Hugging Face Hub ({constants.ENDPOINT}) is unreachable "
            f"({unreachable}) and the file is not in {local_dir}; check the network, HF_ENDPOINT or "
            "HTTPS_PROXY, or copy the file there"
        )

    path = fetch(target)
    config = config_file(target)
    config_path = fetch(config, optional=True) if config else None
    tokenizer = Tokenizer(path)  # a DataError names the file if it is not a usable tokenizer
    return Downloaded(path=path, vocab_size=tokenizer.vocab_size, sha256=tokenizer.sha256, config=config_path)
