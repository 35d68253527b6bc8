"""Each ``ATEN_CPU_CAPABILITY`` gets its own inductor cache folder, unless the user chose one.

torch 2.13's inductor generates CPU kernels for the capability that variable selects, but its
on-disk cache does not key them by it: a kernel compiled at AVX-512 and reused under
``ATEN_CPU_CAPABILITY=avx2`` returned wrong numbers (a compiled RMSNorm + softmax was off by
0.84; the debug recipe's first loss was NaN).

The folder lives in the shared temporary folder, where anyone may have made that name first: a
link there carried inductor's files into the link's target, and a folder that another user can
write would let them plant the compiled kernels that this process loads. So the folder is used
only when it is a real folder of this user's that nobody else can write and this process can;
otherwise compiling goes to a fresh private folder for this process (removed at exit), and one
line says why. Runs before torch is imported (``titanctl/__init__.py``): nothing here imports it.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import sys
import tempfile

from titanctl.safe_io import cannot_create_in, visible

# How torch spells a capability (default, avx2, avx512, zvector, vsx, sve256, ...). torch ignores
# any other value (inductor warns) and compiles for the CPU's own: the shared default cache fits it.
_CAPABILITY = re.compile(r"[A-Za-z0-9_]{1,32}")


def choose(environ: dict[str, str], temp_root: str) -> tuple[str | None, str | None]:
    """(the cache folder to use, or None to leave torch's default; a note for the user, or None)."""
    capability = environ.get("ATEN_CPU_CAPABILITY", "")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in environ:
        return None, None
    if not _CAPABILITY.fullmatch(capability):
        return None, (f"ATEN_CPU_CAPABILITY={visible(repr(capability))} names no CPU capability: torch ignores it, "
                      "and so does titanctl's choice of inductor cache folder")
    # The uid, not $USER: the name must be a plain file name whatever the environment holds.
    name = f"torchinductor_uid{os.geteuid()}_{capability}"  # torch reads the value as given: no case folding
    folder = os.path.join(temp_root, name)
    problem = _unusable(folder)
    if problem is None:
        return folder, None
    fresh = tempfile.mkdtemp(prefix=f"{name}.", dir=temp_root)  # mode 0700, a name nobody had
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(fresh, ignore_errors=True))
    return fresh, (f"inductor cache folder {visible(folder)} {problem}: this process compiles into "
                   f"{visible(fresh)} instead (removed at exit)")


def _unusable(folder: str) -> str | None:
    """Why ``folder`` cannot be this user's cache (created 0700 if missing), or None."""
    try:
        os.mkdir(folder, 0o700)  # never through a link: a link of that name makes this fail
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    try:
        st = os.lstat(folder)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return "belongs to another user"
    if st.st_mode & 0o022:
        return "can be written by other users"
    reason = cannot_create_in(folder)
    return None if reason is None else f"cannot be written ({reason})"


def apply() -> None:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` for this process (and its children) as ``choose`` says."""
    folder, note = choose(dict(os.environ), tempfile.gettempdir())
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    if note is not None:
        print(f"note: {note}", file=sys.stderr, flush=True)
