"""Command blocks marked runnable in README.md and docs/*.md (the line `<!-- runnable -->` right before a
```bash fence) run as written: the README's tour, on the debug model.

They run with bash from a scratch folder that holds only a link to the repository's recipes/, so they must
write under a relative folder (outputs/...). `titanctl` and `torchrun` are this interpreter's. README.md's
blocks run first, then docs/'s in file order, all in the same folder: a block may use what an earlier one
wrote."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_server import shell_endpoint
from tests.conftest import OFFLINE_ENV

MARKER = "<!-- runnable -->"
# Subcommands the tour cannot run offline (the tests have no network).
NEEDS_THE_HUB = {"download-tokenizer"}


def prelude(titanctl: list[str]) -> str:
    """The blocks' `titanctl` (the session's CLI servers: a fresh interpreter's answers, without paying
    for its start each time) and `torchrun` (this interpreter's), importing this checkout."""
    return (f"set -euo pipefail\ntitanctl() {{ {shlex.join(titanctl)} \"$@\"; }}\n"
            f'torchrun() {{ "{sys.executable}" -m torch.distributed.run "$@"; }}\n')


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """(line of the fence, the commands) of each block of `page` marked runnable."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        where = f"{page.name}:{i + 1}"
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```bash", f"{where}: {MARKER} must precede a ```bash fence"
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{where}: the runnable block is never closed"
        blocks.append((i + 2, "\n".join(lines[i + 2:end])))
    return blocks


def all_runnable_blocks(repo: Path) -> list[tuple[str, int, str]]:
    """(page, line, commands) of every runnable block, in the order they run."""
    found = []
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        found += [(str(page.relative_to(repo)), line, block) for line, block in runnable_blocks(page)]
    return found


def test_the_tour_runs_every_subcommand_and_writes_only_relative_paths(repo):
    blocks = all_runnable_blocks(repo)
    tour = "\n".join(block for page, _, block in blocks if page == "README.md")
    assert tour, f"README.md has no block marked {MARKER}"
    from titanctl.cli.app import app

    names_by_command: dict = {}  # a command and its alias share a function: one of the names will do
    for command in app.registered_commands:
        names_by_command.setdefault(command.callback, set()).add(command.name)
    missing = [sorted(names) for names in names_by_command.values() if not names & NEEDS_THE_HUB
               and not any(re.search(rf"\btitanctl\s+{re.escape(name)}\b", tour) for name in names)]
    assert not missing, f"subcommands the README's tour does not run: {missing}"
    absolute = [(page, line) for page, line, block in blocks if re.search(r"(^|[\s=])/", block)]
    assert not absolute, f"runnable blocks must write under a relative folder, not an absolute path: {absolute}"


def test_a_marker_must_precede_a_bash_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```bash\ntitanctl --help\n```\n")
    assert runnable_blocks(page) == [(2, "titanctl --help")]
    page.write_text(f"{MARKER}\n```bash\ntitanctl --help\n```\n\n{MARKER}\n```\nplain text\n```\n")
    with pytest.raises(AssertionError, match="page.md:6: <!-- runnable --> must precede a ```bash fence"):
        runnable_blocks(page)


def test_runnable_blocks_run_as_written(repo, tmp_path, tmp_path_factory):
    (tmp_path / "recipes").symlink_to(repo / "recipes")
    env = {**os.environ, **OFFLINE_ENV}
    with shell_endpoint(tmp_path_factory.mktemp("cli_socket") / "titanctl.sock") as titanctl:
        for page, line, block in all_runnable_blocks(repo):
            start = time.monotonic()
            proc = subprocess.run([shutil.which("bash"), "-c", prelude(titanctl) + block], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)
            print(f"{page}:{line}: {time.monotonic() - start:.1f} s")
            assert proc.returncode == 0, (f"{page}:{line}: exit {proc.returncode}\n{block}\n"
                                          f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", "recipes"]
