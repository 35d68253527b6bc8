"""Every file a checkpoint names stays inside the checkpoint.

Index files name other files: DCP's ``.metadata`` its data files, Hugging Face's
``model.safetensors.index.json`` its shards, ``titanctl.json`` the files it holds checksums of.
A name is accepted only when it is relative, has no ``..`` part and resolves, symbolic links
followed, inside the checkpoint folder; so a checkpoint someone shared cannot make titanctl
open ``/etc/passwd``, through its JSON or through a link it ships.

One exception keeps the Hugging Face cache usable as a source: a snapshot folder
(``.../models--ORG--NAME/snapshots/REV/``) holds links into its repository's ``blobs/``
folder, so there the repository folder is the boundary.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from titanctl.errors import CheckpointError


def boundary(folder: Path) -> Path:
    """The folder a checkpoint's files must resolve into (see the module docstring)."""
    real = Path(folder).resolve()
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return real


def inside(folder: Path, name: object, what: str) -> Path:
    """``folder / name``, or a one-line CheckpointError if `name` (as `what` gives it) leaves the folder."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{what} names {name!r}, which is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise CheckpointError(f"{what} names {name!r}, a path outside {folder}: refusing to read it")
    path = folder / name
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(boundary(folder)):
        raise CheckpointError(
            f"{what} names {name!r}, a link to {real} outside {folder}: refusing to read it"
        )
    return path


def check_inside(folder: Path, path: Path, what: str) -> Path:
    """A file found in `folder` by listing it: refused if it is a link that leads out of the folder."""
    return inside(folder, Path(path).name, what)
