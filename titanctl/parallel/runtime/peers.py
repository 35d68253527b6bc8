"""When a peer fails first: one line that names its failure, not a gloo traceback.

A rank that refuses to run (a TitanError) leaves its one-line reason in the job's store (torchrun's
agent hosts it, so it outlives the rank) before it exits. A rank whose set-up then breaks because that
peer's sockets closed ("Connection closed by peer", "connectFullMesh failed") reads its peers' reasons
and stops with one line naming the first it finds.

What the config alone decides is checked before a rank joins the process group at all (the Trainer's
preflight); this covers what only shows later, on some ranks (a file one rank cannot read).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import tempfile
import time

from titanctl.errors import TitanError
from titanctl.parallel.runtime import elastic

# What gloo and torch's store say when the other end of a connection is gone.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Connection refused|Broken pipe|"
                        r"connectFullMesh failed")
_STORE_TIMEOUT = datetime.timedelta(seconds=2)
_WAIT_FOR_REASON_S = 2.0  # a peer writes its reason before it exits; its sockets close after


class PeerFailed(TitanError):
    """This rank stopped because another rank of the job failed or left."""


def _key(rank: int | str) -> str:
    return f"failed/{rank}"


def _store():
    world = elastic.int_from_env("WORLD_SIZE", 1, minimum=1)
    return elastic.attempt_store(world, _STORE_TIMEOUT) if world > 1 else None


def publish_failure(message: str) -> None:
    """Leave this rank's reason for failing where its peers look for it (under torchrun, best effort)."""
    rank = os.environ.get("RANK")
    if rank is None or "torch.distributed" not in sys.modules:  # failed before torch: so did its peers
        return
    try:
        store = _store()
        if store is not None:
            store.set(_key(rank), message)
    except (RuntimeError, OSError, TitanError):
        pass  # the agent's store is gone too: torchrun's own summary still names the rank


def wait_for_failure_of(rank: int, seconds: float) -> bool:
    """Whether ``rank`` published why it failed within ``seconds``. Without a store to look in, True after
    3 s (what rank 0 usually needs to say an error that every rank meets)."""
    try:
        store = _store()
    except (RuntimeError, OSError, TitanError):
        store = None
    if store is None:
        time.sleep(min(seconds, 3.0))
        return True
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if store.check([_key(rank)]):
                return True
        except (RuntimeError, OSError):
            return True  # the store is gone: so is the job
        time.sleep(0.05)
    return False


def _peer_reason(rank: int, world_size: int) -> tuple[int, str] | None:
    """(rank, reason) of a peer that published why it failed, or None."""
    try:
        store = _store()
        if store is None:
            return None
        deadline = time.monotonic() + _WAIT_FOR_REASON_S
        while True:
            for peer in range(world_size):
                if peer != rank and store.check([_key(peer)]):
                    return peer, store.get(_key(peer)).decode(errors="replace")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    except (RuntimeError, OSError, TitanError):
        return None


@contextlib.contextmanager
def connecting():
    """Around the forming of a process group: gloo logs a lost peer on standard error itself
    ("[E... ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with ... Connection closed by peer")
    before torch raises it, which ``peer_failures_named`` then says in one line naming the peer's
    failure. Those lines are held back; whatever else the connection prints follows once it is done."""
    sys.stderr.flush()
    stderr = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)  # the file descriptor: gloo's C++ logging writes there, not to sys.stderr
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(stderr, 2)
            os.close(stderr)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not _PEER_GONE.search(line.decode(errors="replace"))]
            if kept:
                os.write(2, b"".join(kept))


def is_peer_gone(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and _PEER_GONE.search(str(error)) is not None


@contextlib.contextmanager
def peer_failures_named(rank: int, world_size: int, during: str):
    """Turn a broken connection to a peer inside the block into one line naming the peer's failure."""
    try:
        yield
    except RuntimeError as e:  # gloo's transport errors, and torch.distributed's DistError family
        if world_size == 1 or not is_peer_gone(e):
            raise
        found = _peer_reason(rank, world_size)
        if found is not None:
            peer, reason = found
            raise PeerFailed(f"stopped {during}: rank {peer} failed: {reason}") from None
        what = _PEER_GONE.search(str(e)).group(0)
        raise PeerFailed(f"stopped {during}: another rank left the job ({what}); torchrun's summary names the rank "
                         "that failed first") from None
