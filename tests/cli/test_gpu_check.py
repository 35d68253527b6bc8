"""scripts/gpu_check.sh on the CPU (`--device cpu`): every step of the GPU check passes, or is skipped
with its reason, and reports its figures, so that the script cannot rot between GPUs; a step that
outlives its budget is killed and failed, and the next one still runs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from tests.cli_server import shell_endpoint
from tests.conftest import OFFLINE_ENV, REPO

sys.path.insert(0, str(REPO / "scripts"))
from gpu_check_steps import STEPS  # the script's own table of steps

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, titanctl: list[str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    extra = ["--titanctl", shlex.join(titanctl)] if titanctl else []
    # One thread a process, as tests/cli/test_profile.py runs: inductor's CPU kernels are specialized for the
    # thread count, so slice_compile then reuses the kernels of that file's compiled run (or leaves its own).
    env = {**os.environ, **OFFLINE_ENV, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args, *extra], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_cpu_mode_passes_or_skips_every_step_with_its_figures(tmp_path, tmp_path_factory):
    out, work = tmp_path / "out", tmp_path / "work"
    start = time.monotonic()
    # titanctl's commands are answered by the session's CLI servers (a fresh interpreter's answers).
    with shell_endpoint(tmp_path_factory.mktemp("gpu_check_socket") / "titanctl.sock") as titanctl:
        # Budgets are for a GPU run's minutes; a busy CI machine may take several times its idle time.
        proc = gpu_check("--device", "cpu", "--out", str(out), "--work", str(work), "--budget-scale", "5",
                         "--deadline", "1500", titanctl=titanctl, timeout=1600)
    seconds = time.monotonic() - start
    report = json.loads((out / "gpu_check.json").read_text())
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-5000:]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in STEPS]
    for step in report["steps"]:
        assert step["status"] in ("passed", "skipped"), step
        assert (step["status"] == "skipped") == bool(step["reason"]) and step["error"] is None, step
        assert f"===== {step['name']} " in log
        for part, why in step.get("skipped_parts", {}).items():
            assert why, (step["name"], part)
    assert report["mode"] == "cpu" and report["device"]["device"] == "cpu" and report["goals"] == []
    assert report["versions"]["torch"], report
    assert steps["install"]["missing"] == [] and "pip install" in steps["install"]["skipped_parts"]
    debug = steps["debug"]
    assert debug["bitwise"] and debug["resumed_steps"] == [3, 4] and len(debug["checkpoint_blocking_seconds"]) == 2
    assert "pinned staging" in debug["skipped_parts"]
    for name in ("debug", "slice_eager", "slice_compile", "slice_transformers", "moe_qwen3", "moe_gpt_oss"):
        assert steps[name]["tps"] > 0 and 0 < steps[name]["mfu"] < 1, (name, steps[name])
    assert steps["slice_compile"]["first_step_seconds"] > 0
    assert steps["slice_float8"]["status"] == "skipped" and "float8" in steps["slice_float8"]["reason"]
    assert steps["slice_transformers"]["titanctl_compile_over_transformers"] > 0
    assert steps["moe_qwen3"]["attention"] == "span attention, span mask"
    assert steps["moe_gpt_oss"]["attention"] == "span attention with sinks, span mask"
    assert 0.85 < steps["memory"]["estimate_over_measured"] < 1.15  # tests/distributed/test_estimate_memory.py's bound
    assert steps["profile"]["timeline"] == "cpu" and "memory snapshot" in steps["profile"]["skipped_parts"]
    infer = steps["infer"]
    assert infer["tokens_equal"] and infer["max_abs_logit_difference"] < 1e-4 and infer["decode_speedup"] > 0
    assert infer["checkpoint"] == "debug/resumed/checkpoint/step-4"  # the debug step's, not one of its own
    print(f"gpu_check --device cpu: {report['seconds']:.0f} s in the script, {seconds:.0f} s in all")


def test_a_step_past_its_budget_is_killed_and_failed_and_the_next_one_runs(tmp_path):
    proc = gpu_check("--device", "cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--only",
                     "debug,slice_float8", "--budget", "debug=3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [("debug", "failed"), ("slice_float8", "skipped")]
    assert steps[0]["error"] == "exceeded its budget of 3 s and was killed (see the log)"
    assert steps[0]["seconds"] < 3 + 10  # SIGTERM, then SIGKILL after a grace of 5 s
    assert "failed: debug (rerun with --only debug)" in proc.stdout
    # A step that the deadline leaves too little time for is not started.
    proc = gpu_check("--device", "cpu", "--out", str(tmp_path), "--only", "install", "--deadline", "5")
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"][0]
    assert proc.returncode == 1 and step["status"] == "failed" and step["error"].startswith("not run: 5 s of the 5 s")


def test_the_cpu_slice_has_the_shapes_of_the_suites_compiled_profile_run():
    """slice_compile's CPU kernels are those of tests/cli/test_profile.py's compiled run (the suite's time:
    a cold compile of its own took 43 of the CPU mode's 108 s): the two keep the same shapes."""
    from gpu_check_steps import SLICE_MODEL, SLICE_MODEL_BY_DEVICE

    from tests.cli.test_profile import TINY

    def shapes(args: list[str]) -> dict[str, str]:
        given = dict(zip(args[::2], args[1::2]))
        return {key: given[key] for key in ("--model.n_layers", "--training.seq_len", "--training.local_batch_size")}

    assert shapes([*SLICE_MODEL, *SLICE_MODEL_BY_DEVICE["cpu"]]) == shapes(TINY)
