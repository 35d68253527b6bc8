"""`titanctl download-tokenizer`: the real huggingface_hub path, offline and against a local stand-in Hub.

The stand-in is an HTTP server on 127.0.0.1 speaking the part of the Hub protocol that
`hf_hub_download` uses (HEAD with X-Repo-Commit/ETag, then GET), pointed at by HF_ENDPOINT.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV
from titanctl.data.download import repo_file
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH

SECRET = "hf_TopSecretToken1234567890"
REPO_ID = "meta-llama/Llama-3.1-8B"  # the default --repo-id


class FakeHub:
    """Serves `files` of one repo; `gated` answers 403 GatedRepo; records the Authorization headers."""

    def __init__(self, files: dict[str, bytes], gated: bool = False) -> None:
        self.files, self.gated, self.auth = files, gated, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _answer(self, with_body: bool) -> None:
                hub.auth.append(self.headers.get("authorization"))
                prefix = f"/{REPO_ID}/resolve/main/"
                name = self.path[len(prefix):] if self.path.startswith(prefix) else None
                if hub.gated:
                    self.send_response(403)
                    self.send_header("X-Error-Code", "GatedRepo")
                    self.send_header("X-Error-Message", "Access to this model is restricted.")
                    self.end_headers()
                    return
                if name not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Error-Message", "Entry not found")
                    self.send_header("X-Repo-Commit", "a" * 40)
                    self.end_headers()
                    return
                body = hub.files[name]
                self.send_response(200)
                self.send_header("X-Repo-Commit", "a" * 40)
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self):
                self._answer(with_body=False)

            def do_GET(self):
                self._answer(with_body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(args, tmp_path, hub_url: str | None = None, **env):
    """The CLI offline (as every test), or online against `hub_url` (HF_ENDPOINT) when given."""
    full_env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf_home"), **env}
    if "HF_TOKEN" not in env:
        full_env.pop("HF_TOKEN", None)
    if hub_url is not None:
        # huggingface_hub also reads TRANSFORMERS_OFFLINE as "offline"
        full_env.pop("HF_HUB_OFFLINE")
        full_env.pop("TRANSFORMERS_OFFLINE")
        full_env["HF_ENDPOINT"] = hub_url
    return titanctl_run(["download-tokenizer", *args], env=full_env, timeout=120,
        cwd=tmp_path,
    )


def test_repo_file_layout():
    assert repo_file("original", None) == "original/tokenizer.model"
    assert repo_file("/original/", "tokenizer.json") == "original/tokenizer.json"
    assert repo_file("", None) == "tokenizer.json"
    assert repo_file("", "tokenizer.model") == "tokenizer.model"


# The CLI, with every DNS lookup and connection it attempts written to $NETWORK_LOG (they still happen).
RECORDING_NETWORK = """
import os, socket
from titanctl.cli.app import main

connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

def record(what):
    with open(os.environ["NETWORK_LOG"], "a") as log:
        log.write(what + "\\n")

def recording_connect(self, address):
    record(f"connect {address}")
    return connect(self, address)

def recording_getaddrinfo(host, port, *args, **kwargs):
    record(f"resolve {host}:{port}")
    return getaddrinfo(host, port, *args, **kwargs)

socket.socket.connect, socket.getaddrinfo = recording_connect, recording_getaddrinfo
main()
"""


def test_offline_fails_at_once_with_one_line_and_no_token(tmp_path):
    """Offline means no network at all: not a single lookup or connection (so no retries either)."""
    log = tmp_path / "network.log"
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf_home"), "NETWORK_LOG": str(log)}
    env.pop("HF_TOKEN", None)
    args = ["download-tokenizer", "--repo-id", REPO_ID, "--tokenizer-path", "original", "--hf-token", SECRET]
    proc = subprocess.run([sys.executable, "-c", RECORDING_NETWORK, *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr and "original/tokenizer.model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert not log.exists(), log.read_text()


def test_the_network_recorder_records(tmp_path):
    """The recorder above sees what the CLI does: online, against an address where nothing listens."""
    log = tmp_path / "network.log"
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf_home"), "NETWORK_LOG": str(log),
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY",
                "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(var, None)  # (a proxy would be where the connection goes)
    proc = subprocess.run([sys.executable, "-c", RECORDING_NETWORK, "download-tokenizer"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert log.read_text().splitlines().count("connect ('127.0.0.1', 9)") == 1, log.read_text()


def test_offline_with_the_file_already_there_succeeds(tmp_path):
    target = tmp_path / "tok" / "original" / "tokenizer.model"
    target.parent.mkdir(parents=True)
    target.write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
    proc = run(["--local-dir", str(tmp_path / "tok")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "vocab 4352" in proc.stdout


def test_download_from_hub_sends_the_token_and_never_shows_it(tmp_path):
    model = DEFAULT_TOKENIZER_PATH.read_bytes()
    with FakeHub({"original/tokenizer.model": model}) as hub:
        proc = run(["--hf-token", SECRET, "--local-dir", "assets/tokenizer"], tmp_path,
                   hub_url=hub.url)
    assert proc.returncode == 0, proc.stderr
    saved = tmp_path / "assets" / "tokenizer" / "original" / "tokenizer.model"
    assert saved.read_bytes() == model
    assert "vocab 4352" in proc.stdout and str(saved.relative_to(tmp_path)) in proc.stdout
    assert proc.stdout.startswith(f"contacting {hub.url} for original/tokenizer.model of {REPO_ID}\n")
    assert f"Bearer {SECRET}" in hub.auth  # the token reached the Hub ...
    assert SECRET not in proc.stdout + proc.stderr  # ... and nowhere else


def test_token_from_environment_and_tokenizer_json_at_top_level(tmp_path):
    from tests.unit.data.test_tokenizer import tokenizer_json

    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    import base64

    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines)}
    body = json.dumps(tokenizer_json(ranks)).encode()
    with FakeHub({"tokenizer.json": body}) as hub:
        proc = run(["--tokenizer-path", "", "--local-dir", str(tmp_path / "t")], tmp_path,
                   hub_url=hub.url, HF_TOKEN=SECRET)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t" / "tokenizer.json").read_bytes() == body
    assert "vocab 4352" in proc.stdout
    assert f"Bearer {SECRET}" in hub.auth and SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", ["gated", "missing-file"])
def test_hub_refusals_are_one_line_without_the_token(tmp_path, case):
    files = {} if case == "missing-file" else {"original/tokenizer.model": b"x"}
    with FakeHub(files, gated=case == "gated") as hub:
        proc = run(["--hf-token", SECRET, "--local-dir", str(tmp_path / "t")], tmp_path,
                   hub_url=hub.url)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    want = "is gated" if case == "gated" else "has no file original/tokenizer.model"
    assert want in proc.stderr, proc.stderr



def test_unreachable_hub_with_the_file_already_there_uses_it(tmp_path):
    import socket

    with socket.socket() as s:  # nothing listens on this port
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    target = tmp_path / "tok" / "original" / "tokenizer.model"
    target.parent.mkdir(parents=True)
    target.write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
    proc = run(["--local-dir", str(tmp_path / "tok")], tmp_path, hub_url=url)
    assert proc.returncode == 0, proc.stderr
    assert "is unreachable" in proc.stdout and f"using {target} as it is" in proc.stdout and "vocab 4352" in proc.stdout
    assert proc.stderr == ""
    assert sorted(p.name for p in (tmp_path / "tok").rglob("*")) == ["original", "tokenizer.model"]


def test_a_hugging_face_tokenizer_comes_with_its_tokenizer_config(tmp_path):
    """Qwen3's layout (`--repo-id Qwen/Qwen3-0.6B --tokenizer-path ""`): tokenizer.json and the
    tokenizer_config.json naming its special tokens, saved side by side so that the folder loads."""
    from tests.unit.data.test_hf_tokenizer import train_qwen_style
    from titanctl.data.tokenizer import Tokenizer

    source = train_qwen_style(tmp_path / "source").parent
    files = {name: (source / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    with FakeHub(files) as hub:
        proc = run(["--tokenizer-path", "", "--local-dir", "qwen"], tmp_path, hub_url=hub.url)
    assert proc.returncode == 0, proc.stderr
    saved = tmp_path / "qwen"
    assert {name: (saved / name).read_bytes() for name in files} == files
    tok = Tokenizer(saved / "tokenizer.json")
    assert tok.bos_id is None and tok.eos_id == tok.special_tokens["<|im_end|>"]
    assert f"vocab {tok.vocab_size}," in proc.stdout and "qwen/tokenizer_config.json" in proc.stdout

    # Offline, the files already there are used as they are.
    proc = run(["--tokenizer-path", "", "--local-dir", "qwen"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"vocab {tok.vocab_size}," in proc.stdout
