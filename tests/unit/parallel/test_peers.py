"""What ranks tell each other when one fails (titanctl/parallel/runtime/peers.py, cli/console.report), with this
test as torchrun's agent: it hosts the job's store, as the agent does for its workers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from titanctl.cli import console
from titanctl.errors import ConfigError, DataError
from titanctl.parallel.runtime import peers


@pytest.fixture
def agent(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2",
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    return dist.PrefixStore("titanctl/attempt_0", store)


def as_rank(monkeypatch, rank: int) -> None:
    monkeypatch.setenv("RANK", str(rank))


GLOO_CLOSED = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10673. "
               "This is typically caused by a remote worker crashing.")


def test_a_broken_set_up_names_the_failure_the_peer_left(agent, monkeypatch):
    as_rank(monkeypatch, 0)
    peers.publish_failure("the data of rank 0 is unreadable")
    as_rank(monkeypatch, 1)
    with pytest.raises(peers.PeerFailed) as e, peers.peer_failures_named(1, 2, "while the job was setting up"):
        raise RuntimeError(GLOO_CLOSED)
    assert str(e.value) == "stopped while the job was setting up: rank 0 failed: the data of rank 0 is unreadable"


def test_a_peer_that_left_without_a_word_is_said_as_such(agent, monkeypatch):
    monkeypatch.setattr(peers, "_WAIT_FOR_REASON_S", 0.1)
    as_rank(monkeypatch, 1)
    with pytest.raises(peers.PeerFailed) as e, peers.peer_failures_named(1, 2, "while loading the model"):
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:144] Connection refused")
    assert str(e.value).startswith("stopped while loading the model: another rank left the job (connectFullMesh "
                                   "failed); torchrun's summary names")


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), ValueError(GLOO_CLOSED)],
                         ids=["other-runtime-error", "not-a-runtime-error"])
def test_other_errors_keep_their_traceback(agent, monkeypatch, error):
    as_rank(monkeypatch, 1)
    with pytest.raises(type(error)), peers.peer_failures_named(1, 2, "while the job was setting up"):
        raise error


def test_a_quiet_rank_leaves_once_rank_0_has_said_the_error(agent, monkeypatch, capsys):
    """An error every rank meets is printed by rank 0 only; the others wait for it to be said, not a fixed time."""
    as_rank(monkeypatch, 1)
    monkeypatch.setattr(console, "_QUIET_RANKS_WAIT_S", 30.0)
    threading.Timer(0.2, lambda: agent.set("failed/0", "the same")).start()
    console.report(ConfigError("tp 3 does not divide 2"))
    assert capsys.readouterr().err == ""


def test_a_quiet_rank_whose_error_rank_0_did_not_meet_says_it_itself(agent, monkeypatch, capsys):
    as_rank(monkeypatch, 1)
    monkeypatch.setattr(console, "_QUIET_RANKS_WAIT_S", 0.2)
    console.report(ConfigError("only rank 1 sees this"))
    assert "error: [rank 1] only rank 1 sees this" in capsys.readouterr().err
    assert agent.get("failed/1") == b"only rank 1 sees this"  # and its peers can name it


def test_rank_0_says_its_error_before_it_publishes_it(agent, monkeypatch, capsys):
    as_rank(monkeypatch, 0)
    console.report(DataError("missing file"))
    assert "error: [rank 0] missing file" in capsys.readouterr().err and agent.get("failed/0") == b"missing file"


STOPPED_BY_TORCHRUN = """
import os, signal, sys
os.environ.update(TORCHELASTIC_RUN_ID="job", RANK="1", WORLD_SIZE="2")
from titanctl.cli import console
from titanctl.errors import ConfigError
from titanctl.parallel.runtime import elastic

def sigterm():  # what torchrun sends the other ranks once one rank has exited
    os.kill(os.getpid(), signal.SIGTERM)

if sys.argv[1] == "after-the-error-file":
    elastic.record_failure = lambda *args, **kwargs: sigterm()
    console.report(ConfigError("tp 3 does not divide 2"))
else:  # while the interpreter shuts down, after it has restored SIGTERM's default action
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    class StoppedAtShutdown:
        def __del__(self):
            sigterm()
    stopped = StoppedAtShutdown()
    console.finish(2)
"""


@pytest.mark.parametrize("moment", ["after-the-error-file", "while-leaving"])
def test_a_rank_that_refused_the_config_exits_2_even_when_torchrun_stops_it(moment):
    """torchrun names the failure with the earliest error file the root cause: a quiet rank that wrote its
    file first and was then killed by torchrun's SIGTERM showed as "exitcode -15 (SIGTERM)" in the summary,
    1 run in 4 on a loaded machine."""
    proc = subprocess.run([sys.executable, "-c", STOPPED_BY_TORCHRUN, moment], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])


def test_while_a_group_connects_gloos_own_lines_about_a_lost_peer_are_held_back(capfd):
    """gloo logs a lost peer on the file descriptor itself, before torch raises the error that
    peer_failures_named turns into one line; what else is written there is kept, in order."""
    with pytest.raises(RuntimeError), peers.connecting():
        os.write(2, b"[W1207 ProcessGroupGloo.cpp:514] a warning that stays\n")
        os.write(2, f"[E1207 02:12:33.413662143 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with {GLOO_CLOSED}\n"
                 .encode())
        os.write(2, b"and what follows it\n")
        raise RuntimeError(GLOO_CLOSED)
    assert capfd.readouterr().err == "[W1207 ProcessGroupGloo.cpp:514] a warning that stays\nand what follows it\n"
