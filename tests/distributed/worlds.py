"""Many training cases, few torchrun launches.

Every case registered for N processes runs in one torchrun world of N processes, one case after
another (workers/world_worker.py). A launch costs each process its interpreter, torch import, gloo
rendezvous and threads; a case in a running world costs only its build and its steps. The layout
tests of every family register their cases here at import, and the first test that asks for a case
of N processes runs the world of N with every selected case of that size.

The session starts every world its selected cases need as soon as collection ends, one world after
another in a background thread (``Worlds.start``), and runs the tests that read them last
(tests/conftest.py): a world's processes spend much of their time waiting on each other's collectives,
and the rest of the suite, mostly one interpreter at a time, uses the CPU they leave.

Under pytest-xdist (`make test` runs two workers) the first worker runs the worlds into a folder every
worker shares, and writes ``world{N}.ran.json`` when the world of N ends; the other workers read the
same folders once that file is there, and never launch a world the first one runs.

A case's folder holds what a lone ``train_worker.py`` run writes (metrics.jsonl), digests of the initial
weights (init_digests_rank{r}.json; a one-process reference also keeps them whole, init_rank0.pt),
the first step's gradients when asked (grads_rank{r}.pt, experts_rank{r}.json), the last step's
parameters when asked (final_rank{r}.pt), what
workers/sync_train_worker.py records when asked, each rank's stdout and stderr, and ``done``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.distributed.harness import WORKERS, torchrun


@dataclass(frozen=True)
class Case:
    key: str
    nproc: int
    args: tuple[str, ...]
    grads: bool  # also dump the first step's gradients
    probe: bool  # train as workers/sync_train_worker.py does: host syncs, log windows, float8's all-gathers
    always: bool  # a reference: run with its world whatever is selected
    prepare: Callable[[Path], None] | None  # writes the files its args name under ROOT, before the world runs
    final: bool  # also dump every parameter, gathered whole, after the last step
    command: str = "train"  # what runs the case: train (titanctl.train.trainer.Trainer) or rl (titanctl.rl.loop.RLTrainer)


_CASES: dict[str, Case] = {}
SECONDS_PER_CASE = 90  # a generous bound per case on a loaded 2-core machine; the world's timeout adds them


ROOT = "{ROOT}"  # in a case's args: the worlds' folder (where ``prepare`` wrote the case's files)


def register(module: str, name: str, nproc: int, args: list[str], grads: bool = False, probe: bool = False,
             always: bool = False, prepare: Callable[[Path], None] | None = None, final: bool = False,
             command: str = "train") -> str:
    """Declare a case (at import, before any world runs); returns its key."""
    key = f"{module.rsplit('.', 1)[-1]}::{name}"
    assert key not in _CASES, f"case {key} registered twice"
    _CASES[key] = Case(key, nproc, tuple(args), grads, probe, always, prepare, final, command)
    return key


class Worlds:
    """Runs each world once (in the background from ``start``, else on first demand) and hands out its
    cases' folders."""

    def __init__(self, root: Path, selected: set[str], runs_worlds: bool = True):
        self.root = root
        self.selected = selected
        self.runs_worlds = runs_worlds  # False: another xdist worker runs them into ``root``
        self.logs: dict[int, str] = {}
        self.ran: dict[int, set[str]] = {}  # the cases each world ran
        self.background: dict[int, threading.Event] = {}  # set once the background thread ran that world
        self.lock = threading.Lock()
        self.summaries: list[str] = []  # one line per world run, printed by the test that reads it

    def start(self) -> None:
        """Run the world of every process count that a selected case needs, largest first, in a
        background thread; ``folder`` waits for the one it reads."""
        sizes = sorted({c.nproc for c in _CASES.values() if c.key in self.selected}, reverse=True)
        self.background = {nproc: threading.Event() for nproc in sizes}

        def run_all() -> None:
            for nproc in sizes:
                try:
                    if self.runs_worlds:
                        try:
                            self._run(nproc, None)
                        finally:
                            self._publish(nproc)
                    else:
                        self._await(nproc)
                finally:
                    self.background[nproc].set()

        self.thread = threading.Thread(target=run_all, name="torchrun worlds", daemon=True)
        self.thread.start()

    def join(self) -> None:
        """Wait for the worlds this process runs (for the other xdist workers, which may still read them)."""
        if self.runs_worlds and getattr(self, "thread", None) is not None:
            self.thread.join()

    def folder(self, key: str) -> Path:
        case = _CASES[key]
        if case.nproc in self.background:
            self.background[case.nproc].wait()
        with self.lock:
            if key not in self.ran.get(case.nproc, ()):
                self._run(case.nproc, key)  # a case that no selected test named: a world of its own
            while self.summaries:
                print("\n" + self.summaries.pop(0))
        folder = self._folder(key)
        errors = sorted(folder.glob("error_rank*.txt"))
        if errors:
            raise AssertionError(f"{key} failed in its world:\n" + "\n".join(e.read_text()[-4000:] for e in errors))
        if not (folder / "done").exists():
            raise AssertionError(f"{key} did not run: the world of {case.nproc} processes ended before it\n"
                                 f"{self.logs[case.nproc][-6000:]}")
        return folder

    def stdout(self, key: str) -> str:
        """What every rank of the case printed, rank 0 first (as torchrun's output holds it)."""
        folder = self.folder(key)
        return "".join(path.read_text() for path in sorted(folder.glob("stdout_rank*.txt")))

    def _folder(self, key: str) -> Path:
        return self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", key)

    def _run(self, nproc: int, asked: str | None) -> None:
        # A world for one case that no selected test named runs that case alone: the session's world of
        # ``nproc`` ran the others into their folders, which another xdist worker may be reading or rerunning.
        cases = [c for c in _CASES.values() if c.nproc == nproc and (
            c.key == asked if asked is not None else c.always or c.key in self.selected)]
        for prepare in dict.fromkeys(c.prepare for c in cases if c.prepare is not None):
            prepare(self.root)
        plan = [{"key": c.key, "args": [a.replace(ROOT, str(self.root)) for a in c.args], "grads": c.grads,
                 "probe": c.probe, "final": c.final, "command": c.command, "folder": str(self._folder(c.key))}
                for c in cases]
        plan_file = self.root / (f"world{nproc}.json" if asked is None else f"world{nproc}-{os.getpid()}.json")
        plan_file.write_text(json.dumps(plan))
        start = time.perf_counter()
        try:
            proc = torchrun(nproc, [str(WORKERS / "world_worker.py")], [str(plan_file)],
                            timeout=60 + SECONDS_PER_CASE * len(cases), check=False)
            log, ending = proc.stdout + proc.stderr, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            log, ending = "".join(_text(out) for out in (e.stdout, e.stderr)), f"timed out after {e.timeout:.0f} s"
        self.logs[nproc] = log
        self.ran.setdefault(nproc, set()).update(c.key for c in cases)
        seconds = {c.key: float((self._folder(c.key) / "done").read_text() or 0)
                   for c in cases if (self._folder(c.key) / "done").exists()}
        slowest = ", ".join(f"{key} {s:.1f} s" for key, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:5])
        self.summaries.append(f"WORLD of {nproc} process(es): {len(cases)} cases in {time.perf_counter() - start:.1f} s "
                              f"({ending}); slowest: {slowest}")

    def _publish(self, nproc: int) -> None:
        """For the other xdist workers, once the world of ``nproc`` ended (or failed to start): written
        whole and renamed into place, so that its presence means the world is over."""
        ran = self.root / f"world{nproc}.ran.json"
        log = self.logs.get(nproc, "the world raised before it ran: see the output of the first xdist worker")
        ran.with_suffix(".tmp").write_text(json.dumps({"cases": sorted(self.ran.get(nproc, ())), "log": log}))
        ran.with_suffix(".tmp").replace(ran)

    def _await(self, nproc: int) -> None:
        """Wait until the worker that runs the worlds has run the world of ``nproc`` (bounded like a launch)."""
        ran = self.root / f"world{nproc}.ran.json"
        cases = sum(c.nproc == nproc for c in _CASES.values())
        deadline = time.monotonic() + 2 * (60 + SECONDS_PER_CASE * cases)
        while not ran.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        if ran.exists():
            data = json.loads(ran.read_text())
            self.logs[nproc] = data["log"]
            self.ran[nproc] = set(data["cases"])
        else:
            self.logs[nproc] = f"{ran} never appeared: the worker that runs the worlds did not finish this one"


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def selected_cases(items) -> set[str]:
    """The case keys that the session's selected tests take as their ``world_case`` parameter, or as their
    ``reference_case`` (a reference that runs only when a test that compares with it does)."""
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in items]
    return {p[name] for p in params for name in ("world_case", "reference_case") if name in p}
