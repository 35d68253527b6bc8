"""Permission checks as a user meets them: root passes every one, so as root a block runs with the
effective uid of ``nobody`` (the kernel then checks as it would for a user's run)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

NOBODY = 65534
PREFIX = "titanctl-unprivileged-"


@contextlib.contextmanager
def as_unprivileged_user():
    """As root: the block runs with nobody's effective uid; as any other user: as is."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@contextlib.contextmanager
def unprivileged_home():
    """A folder the unprivileged user owns and can reach (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        give_away(folder)
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:  # read-only folders cannot be emptied
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(folder)


def give_away(path: Path) -> Path:
    """Everything in the home folder that holds ``path`` given to the unprivileged user (as root)."""
    if os.geteuid() == 0:
        home = next(p for p in [path, *path.parents] if p.name.startswith(PREFIX))
        for p in [home, *home.rglob("*")]:
            os.chown(p, NOBODY, pwd.getpwuid(NOBODY).pw_gid, follow_symlinks=False)
    return path


def read_only(path: Path) -> None:
    """``chmod -R a-w``."""
    for p in [path, *path.rglob("*")]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
