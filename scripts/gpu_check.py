"""Check titanctl on this machine's GPU in one command: every step timed, each on its own budget.

    scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--only STEP,...] [--budget STEP=SECONDS]
        [--budget-scale FACTOR] [--deadline SECONDS] [--work DIR] [--wheels DIR] [--titanctl COMMAND]

The steps (``gpu_check_steps.STEPS``, in this order, cheapest and most telling first) run one after
another, each in a process of its own (a new session): one that outlives its budget is killed with
everything it started and marked failed, and the next one starts. A step that would start with less
than MIN_START_SECONDS of the deadline left is not run (failed, "not run: ..."), so the whole check ends
within ``--deadline`` (default 9 minutes on CUDA, 3 on CPU). ``--out`` (default ``$OUT``, else
outputs/gpu_check) gets ``gpu_check.json`` and ``gpu_check.log`` (every command and its output); the
steps work in ``--work`` (default a temporary folder, removed at the end).

``--device cpu`` runs the same steps with debug shapes on the CPU; the parts that need CUDA (pinned
staging, Float8 speed, the CUDA memory snapshot, MFU against a GPU's peak) are skipped with their
reason. docs/gpu.md says what each figure means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_steps as steps  # beside this file

REPO = Path(__file__).resolve().parents[1]
DEADLINE = {"cuda": 540.0, "cpu": 180.0}
MIN_START_SECONDS = 10.0
KILL_GRACE_SECONDS = 5.0
LOG_LIMIT_BYTES = 15 * 2**20  # a device machine returns files of up to 16 MiB
FORMAT_VERSION = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the GPU check) or cpu (the same steps with debug shapes)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu_check.json and gpu_check.log (default: $OUT, else outputs/gpu_check)")
    parser.add_argument("--only", default="", help="comma-separated steps to run, e.g. slice_float8,infer")
    parser.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                        help="another budget for a step (repeatable)")
    parser.add_argument("--budget-scale", type=float, default=1.0, metavar="FACTOR",
                        help="multiply every step's budget (a slower GPU, a busy CPU); --deadline still holds")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole check (default 540 on cuda, 180 on cpu)")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: temporary, removed)")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl",
                        help="wheels the install step installs (scripts/gpu_wheels.py fills .whl/)")
    parser.add_argument("--titanctl", default="",
                        help="the command that runs titanctl (default: this Python with -m titanctl)")
    parser.add_argument("--run-step", default="", help=argparse.SUPPRESS)  # a step's own process
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def chosen_steps(only: str) -> list[steps.Step]:
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {s.name for s in steps.STEPS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"gpu_check: unknown step {unknown[0]!r}; steps: {', '.join(s.name for s in steps.STEPS)}")
    return [s for s in steps.STEPS if not names or s.name in names]


def budgets(device: str, overrides: list[str], scale: float = 1.0) -> dict[str, float]:
    out = {s.name: s.budget[device] * scale for s in steps.STEPS}
    for item in overrides:
        name, _, seconds = item.partition("=")
        if name not in out:
            raise SystemExit(f"gpu_check: --budget {item!r}: unknown step {name!r}")
        try:
            out[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"gpu_check: --budget {item!r}: expected STEP=SECONDS") from None
    return out


def child_environment(device: str, work: Path) -> dict[str, str]:
    """What every step runs under: offline, this checkout (and the install step's site folder) first
    on the path, titanctl's caches in the work folder unless already chosen, unbuffered output."""
    site = work / steps.SITE_FOLDER
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TIKTOKEN_CACHE_DIR": "", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    env.setdefault("HF_HOME", str(work / "hf"))
    env.setdefault("TITANCTL_CACHE_DIR", str(work / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(site), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # titanctl picks CUDA whenever it sees a GPU
    return env


def run_step(step: steps.Step, context: dict, budget: float, log, env: dict[str, str]) -> dict:
    """The step in its own process session, killed with all it started after ``budget`` seconds."""
    work = Path(context["work"])
    ctx_file, result_file = work / f"{step.name}.context.json", work / f"{step.name}.result.json"
    ctx_file.write_text(json.dumps(context))
    result_file.unlink(missing_ok=True)
    log.write(f"\n===== {step.name} (budget {budget:.0f} s) =====\n")
    log.flush()
    cmd = [sys.executable, __file__, "--run-step", step.name, "--context", str(ctx_file), "--result", str(result_file)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        seconds = time.monotonic() - started
        result = _read_result(result_file) or {}
        result.update(status="failed", error=f"exceeded its budget of {budget:.0f} s and was killed (see the log)")
        return {**result, "seconds": round(seconds, 2)}
    _kill_session(proc)  # whatever it left running
    seconds = time.monotonic() - started
    result = _read_result(result_file)
    if result is None:
        result = {"status": "failed", "error": f"its process ended with exit code {code} and no result (see the log)"}
    return {**result, "seconds": round(seconds, 2)}


def _kill_session(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGKILL:
            return


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def describe(result: dict) -> str:
    """One line per step for the console: status, time, its headline figures."""
    keys = ("gpu", "cpu", "tps", "mfu", "tflops", "bitwise", "estimate_over_measured", "decode_speedup",
            "max_abs_logit_difference", "timeline")
    figures = ", ".join(f"{k} {result[k]}" for k in keys if result.get(k) is not None)
    why = result.get("error") or result.get("reason") or ""
    text = f"  {result['name']:<20} {result['status']:<8} {result['seconds']:7.1f} s  {figures}"
    return text + (f"  [{why}]" if why else "")


def device_summary(results: dict[str, dict]) -> dict | None:
    env = results.get("environment")
    if env is None or env["status"] != "passed":
        return None
    keys = ("device", "gpu", "gpu_count", "capability", "multiprocessors", "memory_total_bytes", "memory_free_bytes",
            "driver", "peak_bf16_tflops", "peak_source", "matmul_bf16_tflops", "cpu", "cores", "peak_fp32_tflops")
    return {k: env[k] for k in keys if k in env}


def versions_summary(results: dict[str, dict]) -> dict | None:
    env = results.get("environment") or {}
    found = dict(env.get("versions") or {})
    installed = (results.get("install") or {}).get("requirements") or {}
    found.update({k: v for k, v in installed.items() if k in found or k == "torchao"})
    return found or None


def goals(results: dict[str, dict]) -> list[dict]:
    """The issue's goals, each with the measured value (None where its step did not measure it)."""

    def figure(step: str, key: str):
        return results.get(step, {}).get(key)

    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)

    memory = figure("memory", "estimate_over_measured")
    table = [
        ("MFU >= 0.45 with bf16 + compile on the 8B slice", figure("slice_compile", "mfu"), lambda v: v >= 0.45),
        ("Float8 rowwise >= 1.3x bf16 + compile, tokens/s",
         ratio(figure("slice_float8", "tps"), figure("slice_compile", "tps")), lambda v: v >= 1.3),
        ("estimate-memory within 5% of the measured peak", memory, lambda v: abs(v - 1) <= 0.05),
        ("infer-tp decode >= 3x transformers' generate()", figure("infer", "decode_speedup"), lambda v: v >= 3),
    ]
    return [{"goal": text, "value": value, "met": None if value is None else bool(test(value))}
            for text, value, test in table]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.run_step:
        return steps.run_in_this_process(args.run_step, json.loads(args.context.read_text()), args.result)
    chosen = chosen_steps(args.only)
    budget = budgets(args.device, args.budget, args.budget_scale)
    deadline = args.deadline if args.deadline is not None else DEADLINE[args.device]
    out = args.out or Path(os.environ.get("OUT") or REPO / "outputs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="titanctl-gpu-check-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    titanctl = shlex.split(args.titanctl) if args.titanctl else [sys.executable, "-m", "titanctl"]
    env = child_environment(args.device, work)
    context = {"device": args.device, "repo": str(REPO), "work": str(work), "titanctl": titanctl,
               "wheels": str(args.wheels.resolve()), "facts": {}}
    report = {
        "format": "titanctl-gpu-check", "version": FORMAT_VERSION, "mode": args.device,
        "command": shlex.join(["scripts/gpu_check.sh", *argv]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deadline_seconds": deadline, "device": None, "versions": None, "goals": [], "steps": [],
    }
    started = time.monotonic()
    print(f"gpu_check ({args.device}): {len(chosen)} steps, deadline {deadline:.0f} s; log in {out / 'gpu_check.log'}",
          flush=True)
    results: dict[str, dict] = {}
    try:
        with open(out / "gpu_check.log", "w") as log:
            for step in chosen:
                left = deadline - (time.monotonic() - started)
                if left < MIN_START_SECONDS:
                    result = {"status": "failed", "seconds": 0.0,
                              "error": f"not run: {max(left, 0):.0f} s of the {deadline:.0f} s deadline were left"}
                else:
                    result = run_step(step, context, min(budget[step.name], left), log, env)
                result = {"name": step.name, **steps.BLANK_RESULT, **result,
                          "budget_seconds": round(min(budget[step.name], max(left, 0)), 1)}
                results[step.name] = result
                report["steps"].append(result)
                context["facts"].update(result.pop("facts", {}))
                print(describe(result), flush=True)
                report.update(device=device_summary(results), versions=versions_summary(results),
                              goals=goals(results) if args.device == "cuda" else [],
                              seconds=round(time.monotonic() - started, 1))
                _write_json(out / "gpu_check.json", report)  # after every step: a killed check keeps what it had
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
        _cap(out / "gpu_check.log")
    failed = [r["name"] for r in report["steps"] if r["status"] == "failed"]
    print(f"gpu_check: {len(report['steps']) - len(failed)} of {len(report['steps'])} steps passed or skipped in "
          f"{report['seconds']:.0f} s" + (f"; failed: {','.join(failed)} (rerun with --only {','.join(failed)})"
                                          if failed else ""), flush=True)
    for goal in report["goals"]:
        verdict = {True: "met", False: "not met", None: "not measured"}[goal["met"]]
        print(f"  goal: {goal['goal']}: {goal['value']} ({verdict})", flush=True)
    return 1 if failed else 0


def _cap(log: Path, limit: int = LOG_LIMIT_BYTES) -> None:
    """Keep the log's beginning and end when it outgrew ``limit`` (what comes back from a device machine
    is limited per file)."""
    if not log.is_file() or log.stat().st_size <= limit:
        return
    data = log.read_bytes()
    cut = f"\n[... {len(data) - limit} bytes of the log left out ...]\n".encode()
    log.write_bytes(data[: limit // 4] + cut + data[-(limit - limit // 4):])


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
