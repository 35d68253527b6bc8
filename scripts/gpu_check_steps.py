"""The steps of scripts/gpu_check.py: what each runs, on CUDA and on CPU, and what it reports.

Each step is a function ``(ctx, out)`` that fills ``out`` with its figures as it goes and raises
``Skip`` (with the reason) or ``StepFailed`` (one line); anything else it raises fails it with its type
and first line. A step runs titanctl as a user does, through its command line (``ctx.titanctl``),
and reads its figures from what titanctl writes: tokens/s, TFLOP/s and MFU come from the Trainer's
metrics.jsonl (its ``mfu`` is a percentage; the figures here are fractions). The peers
(transformers' training step, ``generate()``, logits) are in gpu_check_peers.py.

Nothing here imports torch at module level: the driver never touches the GPU.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SITE_FOLDER = "site"  # under the work folder: the install step's pip --target
BLANK_RESULT = {"status": "failed", "seconds": 0.0, "error": None, "reason": None}
# Where the dense bf16 peak that MFU divides by comes from (titanctl.train.peak.GPU_PEAK_TFLOPS, by name).
PEAK_SOURCES = {
    "H200": "NVIDIA H200 datasheet: the H100 SXM's Tensor Core rates, BF16 1,979 TFLOP/s with 2:4 sparsity, "
            "989 dense (titanctl.train.peak.GPU_PEAK_TFLOPS['H200'])",
    "H100 NVL": "NVIDIA H100 datasheet, H100 NVL: BF16 1,671 TFLOP/s with 2:4 sparsity, 835 dense "
                "(titanctl.train.peak.GPU_PEAK_TFLOPS['H100 NVL'])",
    "H100 PCIe": "NVIDIA H100 datasheet, H100 PCIe: BF16 1,513 TFLOP/s with 2:4 sparsity, 756 dense "
                 "(titanctl.train.peak.GPU_PEAK_TFLOPS['H100 PCIe'])",
    "H100": "NVIDIA H100 datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOP/s with 2:4 sparsity, 989 dense "
            "(titanctl.train.peak.GPU_PEAK_TFLOPS['H100'])",
}
PROMPT = "To be, or not to be, that is the question:"


class Skip(Exception):
    """The step does not apply here; its message is the reason."""


class StepFailed(Exception):
    """The step ran and failed; its message is the one-line error."""


@dataclass
class Context:
    device: str  # "cuda" or "cpu"
    repo: Path
    work: Path
    titanctl: list[str]
    wheels: Path
    facts: dict  # what earlier steps found that later ones read (the torch seen before installing, a checkpoint)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def folder(self, *parts: str) -> Path:
        path = self.work.joinpath(*parts)
        if path.exists():  # a rerun in the same work folder starts clean
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Context, dict], None]
    budget: dict[str, float]  # seconds, by device


# ------------------------------------------------------------------------------ running commands


def command(ctx: Context, cmd: list[str], what: str) -> str:
    """Run ``cmd`` in the repository, its output streamed into the log as it comes; returns the output.
    A non-zero exit fails the step with the command's last error line."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    lines = []
    proc = subprocess.Popen(cmd, cwd=ctx.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = proc.wait()
    sys.stdout.flush()
    if code != 0:
        raise StepFailed(f"{what} exited with code {code}: {last_error(lines)}")
    return "".join(lines)


def titanctl(ctx: Context, *args: str) -> str:
    return command(ctx, [*ctx.titanctl, *args], f"titanctl {args[0]}")


def last_error(lines: list[str]) -> str:
    """The line that says what went wrong: titanctl's one-line error, else a traceback's last line."""
    text = [line.strip() for line in lines if line.strip()]
    for line in reversed(text):
        if line.startswith("error:") or re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):
            return line[:500]
    return text[-1][:500] if text else "(no output)"


def json_output(text: str) -> dict:
    """The JSON object a ``--json`` command printed on a line of its own (warnings may come before or after)."""
    start = 0 if text.startswith("{") else text.find("\n{") + 1
    if start == 0 and not text.startswith("{"):
        raise StepFailed("the command printed no JSON object")
    return json.JSONDecoder().raw_decode(text, start)[0]


def metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise StepFailed(f"no metrics.jsonl in {folder}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rates(rows: list[dict], output: str) -> dict:
    """tokens/s, TFLOP/s and MFU (a fraction) per device from the Trainer's log rows: the median over
    the rows that have rates (the first step, which compiles, has none), the first such window left out
    when there are more (it still warms up caches and allocators); the first step's seconds as the
    Trainer said them."""
    timed = [r for r in rows if r.get("tps") is not None]
    if not timed:
        raise StepFailed("metrics.jsonl has no row with tokens/s (too few steps after the first?)")
    timed = timed[1:] if len(timed) > 1 else timed
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    first = re.search(r"first step ([0-9.]+) s", output)
    return {
        "tps": round(statistics.median(r["tps"] for r in timed), 1),
        "tflops": round(statistics.median(r["tflops"] for r in timed), 4),
        "mfu": round(statistics.median(mfus) / 100, 4) if mfus else None,
        "step_seconds": round(statistics.median(r["step_time"] for r in timed), 5),
        "first_step_seconds": float(first.group(1)) if first else None,
        "memory_gib": max(r.get("memory_gib", 0) for r in rows),
        "windows": len(timed),
    }


# ------------------------------------------------------------------------------ the runs

# The debug recipe as a GPU user would first try it: bf16, compile, op-level selective activation
# checkpointing, async checkpoints with pinned staging (CPU: plain async), deterministic kernels (a
# bitwise resume needs them on CUDA), a save halfway.
DEBUG = ["--config", "recipes/llama3_debug.toml", "--compile.enable", "true", "--activation_checkpoint.mode",
         "selective", "--activation_checkpoint.selective_ac_option", "op", "--checkpoint.enable_checkpoint", "true",
         "--checkpoint.keep_latest_k", "0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
         "--training.deterministic", "true"]
DEBUG_BY_DEVICE = {
    "cuda": ["--training.steps", "20", "--checkpoint.interval", "10", "--training.mixed_precision_param", "bfloat16",
             "--checkpoint.async_mode", "async_with_pinned_mem"],
    "cpu": ["--training.steps", "4", "--checkpoint.interval", "2", "--training.mixed_precision_param", "float32",
            "--checkpoint.async_mode", "async", "--model.n_layers", "2", "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--compile.enable", "false"],
}
# The 8B recipe cut to 2 layers: Llama 3.1 8B's widths, its vocabulary of 128,256 (a padded tokenizer,
# below), seq 8192, one sequence a step, bf16; activation checkpointing off (2 layers fit without it).
SLICE_MODEL = ["--config", "recipes/llama3_8b.toml", "--model.n_layers", "2", "--training.dataset", "bundled",
               "--activation_checkpoint.mode", "none"]
# CPU: the debug model at the shapes of the test suite's tiny compiled runs (tests/cli/test_profile.py's:
# 2 layers, 4 x 64 tokens), so that slice_compile and they share inductor's cached kernels (the 8B recipe's
# fused RMSNorm is its own): at 2 x 64 its cold compile of its own took 43 of the CPU mode's 108 s.
SLICE_MODEL_BY_DEVICE = {
    "cuda": ["--training.seq_len", "8192", "--training.local_batch_size", "1"],
    "cpu": ["--model.flavor", "debugmodel", "--model.tokenizer_path", "", "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32"],
}
SLICE_RUN = {"cuda": ["--training.steps", "15", "--metrics.log_freq", "5"],
             "cpu": ["--training.steps", "4", "--metrics.log_freq", "2"]}
QUIET_RUN = ["--metrics.enable_tensorboard", "false", "--checkpoint.enable_checkpoint", "false",
             "--lr_scheduler.warmup_steps", "2"]
LLAMA3_VOCAB = 128_256


def slice_args(ctx: Context) -> list[str]:
    """The 8B slice's model, data and batch (shared by the training runs, the transformers peer and
    estimate-memory)."""
    extra = ["--model.tokenizer_path", str(padded_tokenizer(ctx))] if ctx.cuda else []
    return [*SLICE_MODEL, *SLICE_MODEL_BY_DEVICE[ctx.device], *extra]


def padded_tokenizer(ctx: Context) -> Path:
    """The bundled tokenizer's ranks padded to Llama 3's 128,000 (+ 256 special tokens), so that the
    embedding and output layer have the 8B's shapes (Meta's tokenizer is gated, the GPU machine offline).
    The padding tokens begin with byte 0xff, which UTF-8 text never holds: text encodes as with the
    bundled tokenizer, and the embedding rows past it are trained as the unused rows of a real vocabulary."""
    path = ctx.work / "tokenizer_128256" / "tokenizer.model"
    if not path.is_file():
        from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, NUM_SPECIAL_TOKENS

        lines = DEFAULT_TOKENIZER_PATH.read_text().splitlines()
        for rank in range(len(lines), LLAMA3_VOCAB - NUM_SPECIAL_TOKENS):
            lines.append(base64.b64encode(b"\xff" + str(rank).encode()).decode() + f" {rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return path


def train(ctx: Context, folder: Path, *args: str) -> tuple[list[dict], str]:
    """``titanctl train`` into ``folder``: its metrics rows and its output."""
    output = titanctl(ctx, "train", *args, "--job.dump_folder", str(folder))
    return metrics(folder), output


# ------------------------------------------------------------------------------ the steps


def environment(ctx: Context, out: dict) -> None:
    import torch

    from titanctl.planning.plan.calibrate import _cpu_name  # /proc/cpuinfo's model name
    from titanctl.train.peak import cpu_peak, gpu_peak_tflops

    out["versions"] = versions(torch)
    if not ctx.cuda:
        peak = cpu_peak(torch.float32)
        out.update(device="cpu", cpu=_cpu_name(), cores=len(os.sched_getaffinity(0)),
                   peak_fp32_tflops=None if peak is None else round(peak.tflops, 4),
                   peak_source="titanctl.train.peak.cpu_peak: " + (peak.describe() if peak else "unknown CPU"))
        out["skipped_parts"] = {"bf16 matmul rate": "measured on GPUs only (a CPU without bf16 units takes minutes)"}
        return
    if not torch.cuda.is_available():
        raise StepFailed(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; "
                         "use --device cpu for the CPU check")
    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info(0)
    key = next((k for k in PEAK_SOURCES if k in name), None)
    out.update(
        device="cuda", gpu=name, gpu_count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
        multiprocessors=props.multi_processor_count, memory_total_bytes=total, memory_free_bytes=free,
        driver=nvidia_smi("driver_version"), peak_bf16_tflops=gpu_peak_tflops(name),
        peak_source=PEAK_SOURCES[key] if key else "no datasheet figure for this GPU in titanctl.train.peak: "
        "MFU is not reported (set metrics.peak_tflops)",
    )
    out["matmul_bf16_tflops"] = matmul_rate(torch)


def versions(torch) -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "torchao", "transformers", "numpy", "datasets", "titanctl"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi(field: str) -> str | None:
    """One read-only query of nvidia-smi (None where it is absent)."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


def matmul_rate(torch) -> float:
    """TFLOP/s of an 8192 x 8192 x 8192 bf16 product on random data (median of 10 after 3 warm-ups,
    CUDA events): what this card reaches, beside the datasheet peak that MFU divides by."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return round(2 * n**3 / statistics.median(times) / 1e12, 1)


def install(ctx: Context, out: dict) -> None:
    site = ctx.work / SITE_FOLDER
    out["skipped_parts"] = {}
    if not ctx.cuda:
        out["skipped_parts"]["pip install"] = (
            "the CPU mode checks the environment it runs in; on a GPU machine this step installs "
            f"{ctx.wheels.name}/ and the project with pip --target")
    else:
        wheels = sorted(str(p) for p in ctx.wheels.glob("*.whl"))
        if not wheels:
            out["skipped_parts"]["wheels"] = f"no wheels in {ctx.wheels} (scripts/gpu_wheels.py fills it)"
        out["wheels"] = [Path(w).name for w in wheels]
        # One pip run: a second one into the same --target keeps the first's bin/ (titanctl's script lost).
        command(ctx, [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                      "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target",
                      str(site), *wheels, str(ctx.repo)], "pip install")
    probe = json_output(command(ctx, [sys.executable, __file__, "requirements"], "the requirements probe"))
    out.update(probe)
    before = ctx.facts.get("torch")
    if before and probe["torch"] != before:
        raise StepFailed(f"torch changed from {before['version']} ({before['file']}) to {probe['torch']['version']} "
                         f"({probe['torch']['file']}): an install must never replace the image's torch")
    if probe["missing"]:
        raise StepFailed(f"requirements missing: {', '.join(probe['missing'])}")
    binary = [str(site / "bin" / "titanctl")] if ctx.cuda else ctx.titanctl
    help_text = command(ctx, [*binary, "--help"], "titanctl --help")
    if "estimate-memory" not in help_text:
        raise StepFailed("titanctl --help does not list its subcommands")


def requirements_probe() -> dict:
    """What a fresh interpreter sees: torch's version and file, and each of titanctl's requirements
    (pyproject.toml, no extras) as installed, missing, or of a version it does not accept."""
    import torch
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    installed, missing, mismatched = {}, [], []
    for line in pyproject["project"]["dependencies"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        installed[req.name] = version
        if not req.specifier.contains(version, prereleases=True):
            mismatched.append(f"{req.name} {version} (titanctl asks {req.specifier})")
    return {"torch": {"version": torch.__version__, "file": torch.__file__}, "requirements": installed,
            "missing": missing, "mismatched": mismatched}


def debug(ctx: Context, out: dict) -> None:
    """Train, save halfway (async; pinned staging on CUDA), resume from the halfway save in a new
    process: the resumed steps' losses must equal the first run's bit for bit."""
    run = [*DEBUG, *DEBUG_BY_DEVICE[ctx.device]]
    steps = int(run[run.index("--training.steps") + 1])
    half = int(run[run.index("--checkpoint.interval") + 1])
    if not ctx.cuda:
        out["skipped_parts"] = {
            "pinned staging": "checkpoint.async_mode async_with_pinned_mem needs CUDA: async here",
            # Two cold compiles on a loaded CPU took 127 of make test's seconds; slice_compile times the compile.
            "compile": "eager on CPU: slice_compile is the CPU mode's compile"}
    first = ctx.folder("debug", "first")
    rows, output = train(ctx, first, *run)
    out.update(rates(rows, output))
    out["losses"] = [r["loss"] for r in rows]
    # The manager's own lines: how long training waited for each save, and when it was on disk.
    for key, said in (("checkpoint_blocking_seconds", "staged in"), ("checkpoint_durable_seconds", "durable after")):
        out[key] = [float(s) for s in re.findall(rf"checkpoint step-\d+ {said} ([0-9.]+) s", output)]
    saves = len(out["checkpoint_blocking_seconds"])
    if saves != steps // half:
        raise StepFailed(f"expected {steps // half} async saves; the run said {saves}")
    resumed = ctx.folder("debug", "resumed")
    shutil.copytree(first / "checkpoint" / f"step-{half}", resumed / "checkpoint" / f"step-{half}")
    again, _ = train(ctx, resumed, *run)
    if again[0].get("resumed_from_step") != half:
        raise StepFailed(f"the second run did not resume from step-{half}: its first row is {again[0]}")
    theirs = {r["step"]: r["loss"] for r in rows}
    diffs = [abs(r["loss"] - theirs[r["step"]]) for r in again]
    out.update(resumed_steps=[r["step"] for r in again], max_abs_loss_difference=max(diffs),
               bitwise=all(r["loss"] == theirs[r["step"]] for r in again))
    if len(again) != steps - half:
        raise StepFailed(f"the resumed run logged {len(again)} steps, expected {steps - half}")
    if not out["bitwise"]:
        raise StepFailed(f"the resume is not bitwise: losses of steps {half + 1}-{steps} differ by up to "
                         f"{out['max_abs_loss_difference']:.3g}")
    ctx.facts["checkpoint"] = str(resumed / "checkpoint" / f"step-{steps}")


def slice_run(name: str, *extra: str) -> Callable[[Context, dict], None]:
    def run(ctx: Context, out: dict) -> None:
        out.update(rates(*train(ctx, ctx.folder(name), *slice_args(ctx), *SLICE_RUN[ctx.device], *QUIET_RUN, *extra)))
        out["shape"] = slice_shape(ctx)
        ctx.facts[f"{name}_tps"] = out["tps"]

    return run


def slice_float8(ctx: Context, out: dict) -> None:
    if not ctx.cuda:
        raise Skip("float8 speed needs float8 matmul units (CUDA SM 8.9+); on CPU float8 is emulated, slower than "
                   "fp32 (tests/unit/parallel/test_float8.py checks its numerics)")
    slice_run("slice_float8", "--compile.enable", "true", "--float8.enable_float8_linear", "true",
              "--float8.recipe_name", "rowwise")(ctx, out)


def slice_shape(ctx: Context) -> dict:
    args = slice_args(ctx)

    def value(key: str, default: str | None = None) -> str | None:
        return args[args.index(key) + 1] if key in args else default

    return {"flavor": value("--model.flavor", "8B"), "n_layers": 2, "seq_len": int(value("--training.seq_len")),
            "local_batch_size": int(value("--training.local_batch_size")),
            "vocab_size": LLAMA3_VOCAB if ctx.cuda else "bundled",
            "dtype": value("--training.mixed_precision_param", "bfloat16")}


def slice_transformers(ctx: Context, out: dict) -> None:
    import gpu_check_peers

    out.update(gpu_check_peers.training_step(ctx, slice_args(ctx)))
    out["shape"] = slice_shape(ctx)
    for variant in ("eager", "compile"):
        if ctx.facts.get(f"slice_{variant}_tps"):
            out[f"titanctl_{variant}_over_transformers"] = round(ctx.facts[f"slice_{variant}_tps"] / out["tps"], 3)


MOE = {"cuda": ["--training.steps", "10", "--metrics.log_freq", "5", "--training.mixed_precision_param", "bfloat16"],
       "cpu": ["--training.steps", "3", "--metrics.log_freq", "1", "--model.n_layers", "2", "--training.seq_len", "64",
               "--training.local_batch_size", "2"]}


def moe(recipe: str) -> Callable[[Context, dict], None]:
    """A MoE debug recipe with document masking (block-causal): its routed experts run torch._grouped_mm,
    its masks the kernel titanctl picks for the device (FlexAttention's block mask on CUDA, span attention's
    mask of document starts on CPU; gpt-oss's sinks take span attention everywhere). Compile off: the MoE layers
    run eagerly inside compiled blocks anyway, and FlexAttention is compiled on its own."""

    def run(ctx: Context, out: dict) -> None:
        from titanctl.config.recipe import load_config
        from titanctl.models.common.document_mask import mask_form_for
        from titanctl.models.registry import get_spec
        from titanctl.train.attention_masks import needs_layer_masks

        folder = ctx.folder(Path(recipe).stem)
        rows, output = train(ctx, folder, "--config", recipe, "--model.attn_mask_type", "block_causal",
                             "--compile.enable", "false", *QUIET_RUN, *MOE[ctx.device])
        out.update(rates(rows, output))
        losses = [r["loss"] for r in rows]
        if not all(isinstance(v, float) and v == v for v in losses):
            raise StepFailed(f"non-finite losses: {losses}")
        model = load_config(ctx.repo / recipe, []).model
        args = get_spec(model.name).flavors[model.flavor]
        # The mask form the training step builds (titanctl.train.attention_masks.MicrobatchMasks).
        form = "span" if needs_layer_masks(args) else mask_form_for(ctx.device)
        kernel = {"block": "FlexAttention", "span": "span attention"}[form] + (" with sinks" if args.attention_sinks
                                                                               else "")
        out.update(losses=losses, expert_imbalance_max=rows[-1].get("expert_imbalance_max"),
                   attention=f"{kernel}, {form} mask")

    return run


def memory(ctx: Context, out: dict) -> None:
    """estimate-memory of the 8B slice (CPU: the debug shapes) for one device, validated by two real
    steps on it: on CUDA against torch.cuda.max_memory_allocated per step."""
    estimate_args = _without(slice_args(ctx), "--training.dataset")  # it feeds random ids
    report = json_output(titanctl(ctx, "estimate-memory", *estimate_args, "--world-size", "1", "--device",
                                  ctx.device, "--validate", "--json"))
    validation = report["validation"]
    measured = max(validation["allocated"].values())
    out.update(estimated_peak_bytes=report["peak"], measured_peak_bytes=measured,
               estimate_over_measured=round(report["peak"] / measured, 4), per_step={
                   step: {"estimated": validation["estimated"].get(step), "measured": validation["allocated"][step]}
                   for step in validation["allocated"]},
               estimate_seconds=report.get("seconds"), shape=slice_shape(ctx))


def profile(ctx: Context, out: dict) -> None:
    """titanctl profile of the debug step's settings (3 steps, the last recorded; CUDA: with a memory
    snapshot), then titanctl inspect-trace on the trace it wrote."""
    folder = ctx.folder("profile")
    # The debug step's settings (its compiled kernels are in inductor's cache), less checkpointing.
    run = _without([*DEBUG, *DEBUG_BY_DEVICE[ctx.device]], "--training.steps", "--checkpoint.interval",
                   "--checkpoint.async_mode", "--checkpoint.enable_checkpoint", "--checkpoint.keep_latest_k")
    snapshot = ["--profiling.enable_memory_snapshot", "true"] if ctx.cuda else []
    if not ctx.cuda:
        out["skipped_parts"] = {"memory snapshot": "profiling.enable_memory_snapshot needs CUDA"}
    titanctl(ctx, "profile", *run, "--steps", "3", *snapshot, "--job.dump_folder", str(folder))
    trace_folder = folder / "profile_trace" / "iteration_3"
    report = json_output(titanctl(ctx, "inspect-trace", str(trace_folder), "--json"))
    ranks = report["profile"]["ranks"]
    rank = ranks[0]
    out.update(timeline=rank.get("timeline"), step_us=rank.get("step_us"), compute_us=rank.get("compute_us"),
               top_ops=[op.get("name") for op in rank.get("top_ops", [])[:5]])
    if ctx.cuda:
        path = folder / "memory_snapshot" / "iteration_3" / "rank0_memory_snapshot.pickle"
        if not path.is_file() or path.stat().st_size == 0:
            raise StepFailed(f"no CUDA memory snapshot at {path}")
        if path.read_bytes()[:1] != b"\x80":
            raise StepFailed(f"{path} is not a pickle (what torch.cuda.memory._dump_snapshot writes)")
        out["snapshot_bytes"] = path.stat().st_size
        if rank.get("timeline") != "device":
            raise StepFailed(f"inspect-trace read a {rank.get('timeline')} timeline: the trace has no GPU kernels")


def _without(args: list[str], *keys: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in keys:
            skip = True
        else:
            out.append(a)
    return out


INFER_TOKENS = {"cuda": 128, "cpu": 16}  # 64 or more: infer-tp compiles its decode step


def infer(ctx: Context, out: dict) -> None:
    """convert a titanctl checkpoint to Hugging Face; infer-tp from it, greedy, against transformers'
    generate() on the same device and prompt; transformers' logits from the export against titanctl's
    from its own checkpoint."""
    import gpu_check_peers

    folder = ctx.folder("infer")
    checkpoint = Path(ctx.facts.get("checkpoint", ""))
    if not checkpoint.is_dir():  # the debug step did not leave one: a short run of its own
        train(ctx, folder / "run", "--config", "recipes/llama3_debug.toml", "--model.n_layers", "2",
              "--training.steps", "2", "--metrics.enable_tensorboard", "false", "--training.mixed_precision_param",
              "float32", "--training.seq_len", "64", "--training.local_batch_size", "2")
        checkpoint = folder / "run" / "checkpoint" / "step-2"
    out["checkpoint"] = str(checkpoint.relative_to(ctx.work))
    hf = folder / "hf"
    titanctl(ctx, "convert", str(checkpoint), str(hf), "--to", "hf")
    report = folder / "infer_tp.json"
    titanctl(ctx, "infer-tp", "--checkpoint", str(hf), "--prompt", PROMPT, "--max-new-tokens",
             str(INFER_TOKENS[ctx.device]), "--temperature", "0", "--out", str(report))
    ours = json.loads(report.read_text())
    out.update(decode_tokens_per_second=ours["decode_tokens_per_second"],
               prefill_tokens_per_second=ours["prefill_tokens_per_second"], compiled=ours["compiled"],
               compile_seconds=ours["compile_seconds"], new_tokens=len(ours["tokens"]))
    out.update(gpu_check_peers.generation(ctx, checkpoint, hf, ours))


STEPS = [
    Step("environment", environment, {"cuda": 30, "cpu": 20}),
    Step("install", install, {"cuda": 60, "cpu": 30}),
    Step("debug", debug, {"cuda": 150, "cpu": 70}),
    Step("slice_eager", slice_run("slice_eager", "--compile.enable", "false"), {"cuda": 60, "cpu": 30}),
    Step("slice_compile", slice_run("slice_compile", "--compile.enable", "true"), {"cuda": 100, "cpu": 50}),
    Step("slice_float8", slice_float8, {"cuda": 110, "cpu": 10}),
    Step("slice_transformers", slice_transformers, {"cuda": 60, "cpu": 30}),
    Step("moe_qwen3", moe("recipes/qwen3_moe_debug.toml"), {"cuda": 60, "cpu": 30}),
    Step("moe_gpt_oss", moe("recipes/gpt_oss_debug.toml"), {"cuda": 60, "cpu": 30}),
    Step("memory", memory, {"cuda": 60, "cpu": 30}),
    Step("profile", profile, {"cuda": 60, "cpu": 40}),
    Step("infer", infer, {"cuda": 90, "cpu": 40}),
]


# ------------------------------------------------------------------------------ one step's process


def run_in_this_process(name: str, context: dict, result_path: Path) -> int:
    """Run step ``name`` and write its result (status, error or reason, figures, facts) to ``result_path``."""
    step = next(s for s in STEPS if s.name == name)
    ctx = Context(context["device"], Path(context["repo"]), Path(context["work"]), context["titanctl"],
                  Path(context["wheels"]), dict(context["facts"]))
    if name == "environment":  # what the install step checks torch against
        import torch

        ctx.facts["torch"] = {"version": torch.__version__, "file": torch.__file__}
    out: dict = {}
    result = {"status": "passed"}
    try:
        step.run(ctx, out)
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
    except StepFailed as e:
        result = {"status": "failed", "error": str(e)}
    except BaseException as e:  # a step's own bug fails the step, not the check
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        result = {"status": "failed", "error": f"{type(e).__name__}: {first}"[:500]}
    new_facts = {k: v for k, v in ctx.facts.items() if context["facts"].get(k) != v}
    result_path.write_text(json.dumps({**result, **out, "facts": new_facts}, default=str))
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["requirements"]:
    print(json.dumps(requirements_probe(), indent=1))
