"""Every test runs offline, with its own Hugging Face home and no tiktoken cache."""

import _posixsubprocess
import dis
import functools
import gc
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

_HF_HOME = tempfile.mkdtemp(prefix="titanctl-hf-")
# Token caches and the CPU peak probe are shared by all tests of one session, never the user's.
_CACHE = tempfile.mkdtemp(prefix="titanctl-cache-")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TIKTOKEN_CACHE_DIR": "",
    "HF_HOME": _HF_HOME,
    "WANDB_MODE": "offline",
    "TITANCTL_CACHE_DIR": _CACHE,
}
os.environ.update(OFFLINE_ENV)
# Two xdist workers, the torchrun worlds and the processes they start share a few cores: an OpenMP thread
# that waits sleeps instead of spinning on a core another process needs (results do not change).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Some machines set PYTHONDONTWRITEBYTECODE: then every process the suite starts (several hundred) compiles
# titanctl's and the tests' sources again. Their bytecode goes to __pycache__ (ignored by git) instead.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

REPO = Path(__file__).resolve().parents[1]
TITANCTL = [sys.executable, "-m", "titanctl"]
# Subprocesses import titanctl from this checkout, whatever the venv's editable install points at.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def torchrun_env(**extra: str) -> dict[str, str]:
    """The environment the tests launch torchrun in: offline, this checkout first on the path, one OpenMP
    thread per rank. The session's fork server is started for it (tests/fork_server.py)."""
    return {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# A tiny training run whose checkpoints the checkpoint-trust tests (unit and distributed) copy.
TRUSTED_RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "8",
    "--training.steps", "2",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "1",
    "--checkpoint.keep_latest_k", "0",
]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """Dump folder of one 2-step run of a 2-layer model, one process, full checkpoints at steps 1
    and 2 (with checksums). Shared by the session: tests copy it, never change it."""
    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trusted_run")
    Trainer(load_config(None, [*TRUSTED_RUN, "--job.dump_folder", str(out)])).train()
    return out


@pytest.fixture(scope="session")
def foreign_formats(trained_run, tmp_path_factory) -> dict[str, Path]:
    """The trained run's step-2 weights as a Hugging Face folder (shards and their index) and as a Meta
    folder. Shared by the session: tests copy them, never change them."""
    from titanctl.checkpoint.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("foreign")
    for fmt in ("hf", "meta"):  # a few MB: 2MB shards make several, with an index
        convert_checkpoint(trained_run / "checkpoint" / "step-2", root / fmt, dst_format=fmt,
                           max_shard_size="2MB" if fmt == "hf" else None)
    return {"hf": root / "hf", "meta": root / "meta"}


# ----------------------------------------------------------------------------- slow and fast tests
# `make test` runs every test; `make test-fast` (TITANCTL_FAST_TESTS=1 pytest -m "not slow") only the
# in-process ones. A test is `slow` when
#   1. it lives in tests/distributed (torchrun) or tests/cli (the titanctl binary), or
#   2. its code, a fixture's, or that of a function or class under tests/ they call (followed through
#      module globals, however deep) names a process starter: subprocess.run/Popen/..., os.system/fork/...,
#      multiprocessing, ProcessPoolExecutor, or TITANCTL (the binary's command line), or
#   3. it is marked @pytest.mark.slow: in-process but long, or spawning where 2. cannot see
#      (a library call that starts g++, a pickle payload that runs os.system).
# What 1-3 miss cannot pass unnoticed: in the fast run, starting a process fails the test.
FAST_ENV = "TITANCTL_FAST_TESTS"
TESTS = Path(__file__).resolve().parent
_SLOW_DIRS = (TESTS / "distributed", TESTS / "cli")
# What starts a process, by module: the names that do (a set), or everything but the names that don't.
_SUBPROCESS = frozenset({"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"})
_OS = frozenset({
    "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnl", "spawnle", "spawnlp",
    "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "execl", "execle", "execlp", "execlpe", "execv",
    "execve", "execvp", "execvpe",
})
_MP_HARMLESS = frozenset({"cpu_count", "current_process", "parent_process", "TimeoutError", "ProcessError"})
_SPAWNERS = {
    "subprocess": _SUBPROCESS.__contains__,
    "os": _OS.__contains__,
    "posix": _OS.__contains__,
    "pty": {"fork", "spawn"}.__contains__,
    "concurrent.futures": {"ProcessPoolExecutor"}.__contains__,
    "concurrent.futures.process": {"ProcessPoolExecutor"}.__contains__,
    "multiprocessing": lambda name: name not in _MP_HARMLESS,
    "torch.multiprocessing": lambda name: name not in _MP_HARMLESS,
}


def _spawner(module: object, name: str) -> bool:
    if not isinstance(module, str):
        return False
    for family in ("multiprocessing", "torch.multiprocessing"):
        if module.startswith(family + "."):
            module = family
    test = _SPAWNERS.get(module)
    return bool(test and test(name))


def _defined_under_tests(obj: object) -> bool:
    if isinstance(obj, type):
        return obj.__module__.split(".")[0] == "tests"
    code = getattr(obj, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS)


@functools.cache
def _named(obj: object) -> tuple[bool, tuple]:
    """(whether the code of `obj`, a function or class under tests/, itself names a process starter,
    the functions and classes under tests/ it names). Read once per function."""
    if isinstance(obj, type):  # its methods (a pickled payload's __reduce__, an HTTP handler...)
        return False, tuple(f for f in vars(obj).values() if callable(f) and _defined_under_tests(f))
    glb, todo, named = obj.__globals__, [obj.__code__], []
    while todo:  # the function's own code and that of its nested functions, lambdas, comprehensions
        code = todo.pop()
        todo.extend(k for k in code.co_consts if isinstance(k, types.CodeType))
        module = None  # the module that the previous instruction loaded from a global
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and _spawner(module, ins.argval):
                return True, ()  # subprocess.run
            module = None
            if ins.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or ins.argval not in glb:
                continue
            value = glb[ins.argval]
            if isinstance(value, types.ModuleType):
                module = value.__name__
            elif isinstance(value, list) and value == TITANCTL:
                return True, ()
            elif _spawner(getattr(value, "__module__", None), getattr(value, "__name__", "")):
                return True, ()  # from subprocess import run
            elif _defined_under_tests(value):
                named.append(value)
    return False, tuple(named)


def _spawns(obj: object, seen: set) -> bool:
    """Whether `obj` (a test, a fixture, or a function or class under tests/ that they name, however
    deep) names a way to start a process: subprocess.run, os.system, multiprocessing's Process, TITANCTL..."""
    obj = getattr(obj, "__func__", obj)
    if not _defined_under_tests(obj) or obj in seen:
        return False
    seen.add(obj)
    direct, named = _named(obj)
    return direct or any(_spawns(value, seen) for value in named)


def _is_slow(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow") or any(item.path.is_relative_to(d) for d in _SLOW_DIRS):
        return True
    seen: set = set()
    if _spawns(getattr(item, "obj", None), seen):
        return True
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (fixtureinfo.name2fixturedefs.get(name, ()) if fixtureinfo else ()):
            if _spawns(fixturedef.func, seen):
                return True
    return False


_FORK_SERVER: list[subprocess.Popen] = []


def pytest_sessionstart(session):
    """Each process that runs tests starts a server that the torchrun worker scripts run as forks of
    (tests/fork_server.py), for the environment the tests launch torchrun with."""
    config = session.config
    xdist_controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if os.environ.get(FAST_ENV) == "1" or xdist_controller:
        return
    from tests.fork_server import VARIABLE, start

    proc, path = start(torchrun_env())
    _FORK_SERVER.append(proc)
    os.environ[VARIABLE] = path


def pytest_sessionfinish(session):
    for proc in _FORK_SERVER:
        proc.stdin.close()  # the server ends, and any child it still runs
        proc.wait(timeout=60)


def pytest_collection_finish(session):
    """What collection imported (torch, the test modules) lives as long as the session: the collections
    during the tests skip it (see titanctl/gc_pauses.py)."""
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("slow") and _is_slow(item):
            item.add_marker(pytest.mark.slow)
    # The modules that read the torchrun worlds run last, while the worlds run in the background from
    # the session's start (tests/distributed/worlds.py); each module's tests stay together.
    reads_worlds = {item.module for item in items if "worlds" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) in reads_worlds)


class ProcessInFastRun(BaseException):
    """A BaseException, so that no `except Exception` in the test or the library swallows it."""


def _forbid(what: str, nodeid: str):
    def refuse(*args, **kwargs):
        raise ProcessInFastRun(
            f"{nodeid}: this test spawns a process ({what}): mark it slow (@pytest.mark.slow); "
            f"the fast run ({FAST_ENV}=1) is in-process only")
    return refuse


def _forbid_os(name: str, nodeid: str):
    """os.NAME refused, yet pickled as the real one (posix.NAME): the checkpoint-trust tests pickle
    os.system payloads and match the name in the refusal."""
    refuse = _forbid(f"os.{name}", nodeid)
    refuse.__module__, refuse.__name__, refuse.__qualname__ = os.name, name, name
    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In the fast run a test not marked slow cannot start a process: not in its fixtures (of any
    scope: this wraps setup too), not in library code (torch inductor's g++ and compile workers
    included: a test that compiles is slow), not through multiprocessing."""
    if os.environ.get(FAST_ENV) != "1" or item.get_closest_marker("slow"):
        return (yield)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _forbid("subprocess.Popen", item.nodeid))
        # multiprocessing's spawn and forkserver start methods (and Popen's own child) go through here.
        mp.setattr(_posixsubprocess, "fork_exec", _forbid("fork_exec", item.nodeid))
        posix = sys.modules[os.name]
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                refuse = _forbid_os(name, item.nodeid)
                mp.setattr(os, name, refuse)
                mp.setattr(posix, name, refuse)
        return (yield)
