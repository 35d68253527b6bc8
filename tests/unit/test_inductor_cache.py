"""A kernel compiled for one ATEN_CPU_CAPABILITY is never reused under another (torch 2.13's
inductor cache does not tell them apart, and the reused kernel computed wrong numbers)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.unprivileged import NOBODY, as_unprivileged_user, give_away, read_only, unprivileged_home
from titanctl import _inductor_cache

COMPILED_VS_EAGER = """
import titanctl  # sets the cache folder before inductor is imported
import torch

def f(x, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).softmax(-1)

torch.manual_seed(0)
x, w = torch.randn(64, 256), torch.randn(256)
print((torch.compile(f)(x, w) - f(x, w)).abs().max().item())
"""


def test_each_cpu_capability_compiles_its_own_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)  # a cold default cache, shared by both runs
    errors = []
    # The CPU's own capability first (AVX-512 here), then AVX2 with the cache the first one warmed:
    # without a cache per capability the second run got 0.84 (and a compiled decode step aborted).
    for capability in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        out = subprocess.run([sys.executable, "-c", COMPILED_VS_EAGER], env={**env, **capability},
                             capture_output=True, text=True, timeout=300, check=True)
        errors.append(float(out.stdout.split()[-1]))
    assert max(errors) < 1e-5, errors
    assert any(p.name.startswith("torchinductor_") and p.name.endswith("_avx2") for p in tmp_path.iterdir())


# The folder titanctl picks lies in the shared temporary folder, where anyone may have made its name
# first (issue 47): it is used only when it is a private folder of this user's that this process can write.


@pytest.fixture
def temp_root():
    with unprivileged_home() as folder:
        yield folder


def choose_as_user(temp_root: Path, capability: str = "avx2"):
    with as_unprivileged_user():
        return _inductor_cache.choose({"ATEN_CPU_CAPABILITY": capability}, str(temp_root))


def test_the_folder_is_made_private_and_then_reused(temp_root):
    folder, note = choose_as_user(temp_root)
    assert note is None and Path(folder) == temp_root / f"torchinductor_uid{os.geteuid() or NOBODY}_avx2"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert choose_as_user(temp_root) == (folder, None)


def planted_link(temp_root: Path, target: Path) -> Path:
    link = temp_root / f"torchinductor_uid{os.geteuid() or NOBODY}_avx2"
    link.symlink_to(target)
    give_away(link)
    return link


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_planted_link_is_never_followed(temp_root, kind):
    target = temp_root / "victim"
    target.mkdir() if kind == "folder" else target.write_bytes(b"precious")
    link = planted_link(temp_root, target)
    folder, note = choose_as_user(temp_root)
    assert note.startswith(f"inductor cache folder {link} is a symbolic link: this process compiles into ")
    assert Path(folder).parent == temp_root and not Path(folder).is_symlink() and "\n" not in note
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and not any(Path(folder).iterdir())
    assert (list(target.iterdir()) == []) if kind == "folder" else target.read_bytes() == b"precious"


def test_a_read_only_cache_folder_gives_way_to_a_fresh_one(temp_root):
    folder, _ = choose_as_user(temp_root)
    read_only(Path(folder))
    fresh, note = choose_as_user(temp_root)
    assert fresh != folder and "cannot be written (Permission denied)" in note


def test_a_folder_that_another_user_made_or_can_write_is_not_used(temp_root):
    folder = temp_root / f"torchinductor_uid{os.geteuid() or NOBODY}_avx2"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # as a planted folder would be: others may put kernels in it
    give_away(folder)
    fresh, note = choose_as_user(temp_root)
    assert fresh != str(folder) and "can be written by other users" in note
    if os.geteuid() == 0:
        os.chown(folder, 0, 0)
        folder.chmod(0o700)
        fresh, note = choose_as_user(temp_root)
        assert fresh != str(folder) and "belongs to another user" in note


@pytest.mark.parametrize("capability", ["avx2/../../x", "../avx2", "avx2 ", "a" * 100])
def test_a_capability_that_is_not_a_name_never_reaches_a_path(temp_root, capability):
    folder, note = choose_as_user(temp_root, capability)
    assert folder is None and "names no CPU capability: torch ignores it" in note
    assert [p.name for p in temp_root.iterdir()] == []


def test_a_cache_folder_the_user_chose_is_left_alone(temp_root):
    env = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/anywhere"}
    assert _inductor_cache.choose(env, str(temp_root)) == (None, None)
    assert _inductor_cache.choose({}, str(temp_root)) == (None, None)
