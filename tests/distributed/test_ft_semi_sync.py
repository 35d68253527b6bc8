"""LocalSGD and DiLoCo (fault_tolerance.semi_sync_method) through torchft's own local_sgd module, each
equal to a one-process simulation of the same algorithm written here (1e-5): scripts/ft_local.py runs
2 replica groups of 1 process; the simulation trains two copies of the model in this process with
titanctl's own step, each on its group's share of the data, and syncs them as the algorithm says.

In both runs group 1 is SIGKILLed after step 3, between two syncs (local_sgd: every 2 steps; diloco:
2 fragments, one every 2 steps), and started again. It loses only its unsynchronized step: it joins
group 0's sync at step 4 (--min-replicas 2 makes group 0 wait there for it) and heals from group 0;
that sync's share of group 1 is then group 0's own, so the sync averages group 0 alone. Its stream goes
back to where it stood at its sync of step 2: the samples of step 3 are trained again at step 5.

The DiLoCo run also writes checkpoints (group 0, steps 3 and 6). The whole job started again from a copy
of its dump folder at step 3, between two syncs, repeats it bit for bit from there: group 0 loads the
checkpoint, its fragments' global weights and outer momentum with it; group 1 comes back as after the kill.
"""

from __future__ import annotations

import copy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests import fork_server
from tests.conftest import REPO, torchrun_env
from tests.distributed.harness import WORKERS, rows, sample_log
from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.checkpoint.trust.reader import DCPFolder
from titanctl.config.recipe import load_config
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.parallel.layouts.weight_init import canonical_name
from titanctl.parallel.runtime.fault_tolerance import model_fragments
from titanctl.train.trainer import Trainer

STEPS, KILL_STEP, REJOIN_STEP = 6, 3, 4  # a sync ends steps 2, 4 and 6 in both methods
TRAIN = [
    "--model.n_layers", "2", "--training.seq_len", "32", "--training.global_batch_size", "8",
    "--training.local_batch_size", "4", "--training.steps", str(STEPS), "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
    "--fault_tolerance.outer_lr", "0.5",
    # group 0 waits at its sync of step 4 while group 1 starts again (a loaded machine: tens of seconds)
    "--fault_tolerance.quorum_timeout_seconds", "150", "--comm.train_timeout_seconds", "200",
]
METHODS = {"local_sgd": ["--fault_tolerance.sync_steps", "2"],
           "diloco": ["--fault_tolerance.sync_steps", "4", "--fault_tolerance.fragments", "2"]}
# The DiLoCo run's checkpoints: step 3 lies between the syncs of steps 2 (fragment 0, which then has outer
# momentum) and 4 (fragment 1, none yet). A whole-job restart from it is exact only if it holds both.
CHECKPOINTS = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(KILL_STEP), "--checkpoint.keep_latest_k", "0"]
# A killed group restarts as slowly as a real one would: as a fork it rejoins before the others trained without it.
ENV = torchrun_env(**fork_server.OWN_PROCESSES)


def options(method: str) -> list[str]:
    return [*TRAIN, "--fault_tolerance.semi_sync_method", method, *METHODS[method]]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Both methods' runs at once: most of a launch is start-up latency (torchrun, the Lighthouse, the
    first quorum), which overlaps with the other launch and with the simulations in this process."""
    started = {}
    for method in METHODS:
        out = tmp_path_factory.mktemp(method)
        kill = ["--kill-group", "1", "--kill-at-step", str(KILL_STEP)]
        started[method] = launch(method, out, kill, ["--test-hold-for-kill", f"1:{KILL_STEP}"]), out
    yield started
    stop([proc for proc, _ in started.values()])


def launch(method: str, out: Path, launcher: list[str], worker: list[str]) -> subprocess.Popen:
    checkpoints = CHECKPOINTS if method == "diloco" else []
    cmd = [sys.executable, str(REPO / "scripts" / "ft_local.py"), "--groups", "2", "--procs-per-group", "1",
           "--dump-folder", str(out), "--min-replicas", "2", *launcher, "--worker", str(WORKERS / "ckpt_worker.py"),
           "--", *options(method), *checkpoints, "--test-dump-final", *worker]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:  # a test that failed first: ft_local's interrupt kills its groups
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def restarted(launches, tmp_path_factory) -> tuple[subprocess.Popen, Path]:
    """The whole DiLoCo job again, started as soon as its kill run ended (during the simulation): both
    groups, the same command without the kill, on a copy of its dump folder without the checkpoints after
    step KILL_STEP."""
    folder = tmp_path_factory.mktemp("diloco_again") / "out"
    shutil.copytree(finished(launches, "diloco"), folder)
    for later in (folder / "replica_0" / "checkpoint").iterdir():
        if int(later.name.removeprefix("step-")) > KILL_STEP:
            shutil.rmtree(later)
    proc = launch("diloco", folder, [], [])
    yield proc, folder
    stop([proc])


def finished(launches, method: str) -> Path:
    return wait(*launches[method])


def wait(proc: subprocess.Popen, out: Path) -> Path:
    if proc.returncode is None:  # once: a second communicate() finds the pipe closed
        proc.output, _ = proc.communicate(timeout=300)
    logs = "\n".join((out / f"replica_{i}.log").read_text()[-3000:] for i in range(2))
    assert proc.returncode == 0, f"ft_local exit {proc.returncode}\n{proc.output[-2000:]}\n{logs}"
    return out


def simulate(method: str, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """Both groups in one process: two Trainers (the same init from the seed), group g reading data-parallel
    rank g of 2, synced as the algorithm says, group 1 down from after KILL_STEP to REJOIN_STEP."""
    cfg_ft = load_config(None, options(method)).fault_tolerance
    groups = []
    for g in range(2):
        trainer = Trainer(load_config(None, [*options(method), "--job.dump_folder", str(tmp_path / f"sim{g}")]))
        old = trainer.loader
        trainer.loader = TokenWindowLoader(
            old.sources, trainer.tokenizer, seq_len=old.seq_len, global_batch_size=old.global_batch_size,
            local_batch_size=old.local_batch_size, dp_rank=g, dp_degree=2, seed=old.seed,
        )
        groups.append(trainer)
    models = [t.model_parts[0] for t in groups]
    n = cfg_ft.fragments if method == "diloco" else 1
    every = cfg_ft.sync_steps // n  # steps between two syncs (of one fragment each, for diloco)
    fragments = [model_fragments(m, n) for m in models]
    # The global weights of each fragment, and its outer Nesterov SGD over them.
    global_params = [[p.detach().clone().requires_grad_() for p in f.parameters()] for f in fragments[0]]
    outer = [torch.optim.SGD(ps, lr=cfg_ft.outer_lr, momentum=cfg_ft.outer_momentum, nesterov=cfg_ft.outer_nesterov)
             for ps in global_params]
    syncs = 0
    last_sync_position = copy.deepcopy(groups[1].loader.state_dict())  # before its first sync: its beginning
    for step in range(1, STEPS + 1):
        for g, t in enumerate(groups):
            if not (g == 1 and KILL_STEP < step <= REJOIN_STEP):
                t.train_step()
                t.step += 1
        if step % every:
            continue
        if step == REJOIN_STEP:  # group 1 heals from group 0 in the sync's quorum; its stream: at its last sync
            down = groups[1]
            models[1].load_state_dict(models[0].state_dict())
            down.optimizer.load_state_dict(copy.deepcopy(groups[0].optimizer.state_dict()))
            down.lr_scheduler.load_state_dict(groups[0].lr_scheduler.state_dict())
            down.loader.load_state_dict(last_sync_position)
            down.step = groups[0].step
        with torch.no_grad():
            if method == "local_sgd":
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(list(ps)).mean(0)
                    for p in ps:
                        p.copy_(mean)
            else:
                f = syncs % n
                for i, ps in enumerate(zip(*(frag[f].parameters() for frag in fragments))):
                    global_params[f][i].grad = torch.stack([global_params[f][i] - p for p in ps]).mean(0)
                outer[f].step()
                for i, ps in enumerate(zip(*(frag[f].parameters() for frag in fragments))):
                    for p in ps:
                        p.copy_(global_params[f][i])
        syncs += 1
        if step <= KILL_STEP:
            last_sync_position = copy.deepcopy(groups[1].loader.state_dict())
    finals = [{canonical_name(k): p.detach().clone() for k, p in m.named_parameters()} for m in models]
    for t in groups:
        t.close()
    return finals


@pytest.mark.parametrize("method", list(METHODS))
def test_semi_sync_equals_one_process_simulation(launches, method, tmp_path, request):
    if method == "diloco":
        request.getfixturevalue("restarted")  # runs during the simulation
    expected = simulate(method, tmp_path)  # while the launches run
    out = finished(launches, method)
    for g in range(2):
        got = torch.load(out / f"replica_{g}" / "final_rank0.pt")
        assert got.keys() == expected[g].keys()
        for name in got:
            torch.testing.assert_close(got[name], expected[g][name], rtol=1e-5, atol=1e-6, msg=f"{method} {g} {name}")
    if method == "local_sgd":  # its last sync (steps is a multiple of sync_steps) left the groups equal
        assert all(torch.equal(expected[0][k], expected[1][k]) for k in expected[0])
    assert [r["step"] for r in rows(out / "replica_0")] == list(range(1, STEPS + 1))
    group1 = rows(out / "replica_1")
    # The rows it wrote before the kill stay; it trained no step of its own until the sync it healed in.
    assert [r["step"] for r in group1] == [*range(1, KILL_STEP + 1), *range(REJOIN_STEP + 1, STEPS + 1)]
    healed = [r for r in group1 if "heal_seconds" in r]
    assert [(r["step"], r["missed_steps"]) for r in healed] == [(REJOIN_STEP + 1, REJOIN_STEP - KILL_STEP)]
    # Its stream: the batch of its unsynchronized step 3 comes again at step 5, then on; none skipped.
    drawn = {e["step"]: e for e in sample_log(out / "replica_1")}  # a step drawn twice: the last draw
    assert sorted(drawn) == [*range(1, KILL_STEP + 1), *range(REJOIN_STEP + 1, STEPS + 1)]
    assert drawn[REJOIN_STEP + 1]["rows"] == drawn[KILL_STEP]["rows"]
    synced_in = [drawn[s] for s in (1, 2, 5, 6)]
    stride = synced_in[1]["consumed_before"]
    assert [e["consumed_before"] for e in synced_in] == [stride * i for i in range(4)]
    ids = [row for e in synced_in for row in e["rows"]]
    assert len(ids) == len(set(ids))


def test_diloco_whole_job_restart_between_syncs_is_bitwise(launches, restarted, tmp_path):
    """From the checkpoint of step 3 (between syncs): group 0's later losses, group 1's after its heal
    (in the sync of step 4, as after the kill; its stream back at its last sync before step 3) and both
    groups' final weights are the kill run's, bit for bit."""
    out = finished(launches, "diloco")
    step = out / "replica_0" / "checkpoint" / f"step-{KILL_STEP}"
    assert {k.split(".", 1)[0] for k in DCPFolder(step).entries} >= {"diloco"}
    convert_checkpoint(step, tmp_path / "hf", dst_format="hf")  # while the restart runs: the weights only
    exported = [k for f in (tmp_path / "hf").glob("*.safetensors") for k in safe_open(f, "pt").keys()]
    assert len(exported) == len(torch.load(out / "replica_0" / "final_rank0.pt")), exported
    again = wait(*restarted)
    for g in range(2):
        before, after = ({r["step"]: r for r in rows(run / f"replica_{g}")} for run in (out, again))  # a step's last
        replayed = range(KILL_STEP + 1 if g == 0 else REJOIN_STEP + 1, STEPS + 1)
        assert [after[s]["loss"] for s in replayed] == [before[s]["loss"] for s in replayed], g
        a, b = torch.load(out / f"replica_{g}" / "final_rank0.pt"), torch.load(again / f"replica_{g}" / "final_rank0.pt")
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == [], g
    healed = [r["step"] for r in rows(again / "replica_1") if "heal_seconds" in r]
    assert healed[-1] == REJOIN_STEP + 1, healed
