"""A digest of what titanctl's CLI does on the debug recipes: equal digests from two trees mean that
they wrote the same bytes and printed the same lines (timings and the scratch folder's path masked).

For each family's debug recipe: train a few steps (fp32, no compile, seed 0, checkpoints of both
steps), convert the last step to every format the family has and back (HF -> DCP), generate greedily
from it (infer-tp, one process), and estimate its memory; then `plan` (a published flavor on
datasheet devices) and `inspect-trace` on fixed hand-built traces and Flight Recorder dumps. It prints
one line per file written (relative path and SHA-256) and per command (its masked output's SHA-256),
then the digest of everything. ``--show`` also prints every masked output line.

What two equal runs write differently is compared in a canonical form: a DCP index without its save
id and folder, titanctl.json without the index's checksum, metrics.jsonl without timings and memory.
It runs the titanctl of the tree it is in (PYTHONPATH = that tree), so run it from each tree, with the
same ``--work`` folder (configs record it), to compare:

    PYTHONPATH=. .venv/bin/python scripts/behaviour_digest.py --work /tmp/digest > new.txt
    git archive OLD | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old .venv/bin/python /tmp/old/scripts/behaviour_digest.py --work /tmp/digest > old.txt

(a tree without the script: copy this file into it). About 10 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
# Formats beyond DCP and Hugging Face that each family exists in (ModelSpec.formats).
EXTRA_FORMATS = {"llama3": ("meta", "torchtune", "torchtitan"), "qwen3": ("torchtitan",),
                 "qwen3_moe": ("torchtitan",), "deepseek_v3": ("torchtitan",), "gpt_oss": ("torchtitan",)}
TRAIN = [
    "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "4",
    "--training.global_batch_size", "4", "--training.seed", "0", "--training.mixed_precision_param", "float32",
    "--compile.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
    "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1",
    "--checkpoint.keep_latest_k", "0",
]
# What differs between two runs of the same tree: durations, rates and the process's memory, and dates.
TIMINGS = [
    (re.compile(r"\b\d[\d,]*(\.\d+)?(e[-+]?\d+)?\s?(s|ms|us|µs|min)\b"), "<time>"),
    (re.compile(r"\b(tps|tflops|mfu|memory|peak RSS)\s+[\d,.]+(%| GiB| MiB)?"), r"\1 <measured>"),
    (re.compile(r"[\d,.]+(\s+)(tokens/s|tok/s|steps/s)"), r"<rate>\1\2"),
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?"), "<date>"),
]


def mask(text: str, work: Path) -> str:
    text = text.replace(str(work), "<work>").replace(str(REPO), "<repo>")
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    return text


def hand_built_traces(folder: Path) -> None:
    """Two ranks' profiler traces and two ranks' Flight Recorder dumps (rank 1 one collective behind)."""
    def x(name, ts, dur, tid=1, cat="cpu_op", pid=100):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": {}}

    for rank, slow in ((0, 0), (1, 300)):
        events = [x("ProfilerStep#1", 0, 1000 + slow, cat="user_annotation", pid=rank),
                  x("aten::linear", 0, 400 + slow, pid=rank), x("aten::mm", 50, 300, pid=rank),
                  x("c10d::allreduce_", 400 + slow, 50, pid=rank), x("aten::relu", 600 + slow, 200, pid=rank),
                  x("gloo:all_reduce", 450 + slow, 300, tid=2, cat="user_annotation", pid=rank)]
        doc = {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "traceEvents": events}
        (folder / "profile").mkdir(exist_ok=True)
        trace = gzip.compress(json.dumps(doc).encode(), mtime=0)
        (folder / "profile" / f"rank{rank}_trace.json.gz").write_bytes(trace)
        entries = [{"collective_seq_id": s, "profiling_name": "gloo:all_reduce", "process_group": ["0", "default"],
                    "input_sizes": [[4, 8]], "input_dtypes": ["Float"], "state": "scheduled"}
                   for s in range(1, 4 - rank)]
        dump = {"rank": rank, "entries": entries, "pg_config": {"0": {"name": "0", "desc": "default", "ranks": [0, 1]}}}
        (folder / "fr").mkdir(exist_ok=True)
        (folder / "fr" / f"rank{rank}.json").write_text(json.dumps(dump))


def commands(work: Path) -> list[tuple[str, list[str]]]:
    """(label, titanctl arguments), in the order they run (later ones read what earlier ones wrote)."""
    out = []
    for family in FAMILIES:
        recipe = str(REPO / "recipes" / f"{family}_debug.toml")
        run = work / family
        step = run / "checkpoint" / "step-2"
        out.append((f"{family} train", ["train", "--config", recipe, *TRAIN, "--job.dump_folder", str(run)]))
        out.append((f"{family} -> hf", ["convert", str(step), str(run / "hf"), "--to", "hf"]))
        out.append((f"{family} hf -> dcp", ["convert", str(run / "hf"), str(run / "hf_dcp"), "--to", "dcp"]))
        for fmt in EXTRA_FORMATS[family]:
            out.append((f"{family} -> {fmt}", ["convert", str(step), str(run / fmt), "--to", fmt]))
            out.append((f"{family} {fmt} -> dcp", ["convert", str(run / fmt), str(run / f"{fmt}_dcp"), "--to", "dcp",
                                                    "--from", fmt, "--config", recipe]))
        out.append((f"{family} infer-tp", ["infer-tp", "--checkpoint", str(step), "--prompt", "To be", "--config",
                                           recipe, "--max-new-tokens", "8", "--temperature", "0", "--no-compile"]))
        out.append((f"{family} estimate-memory", ["estimate-memory", "--config", recipe, "--world-size", "2",
                                                   "--training.seq_len", "64", "--training.local_batch_size", "2",
                                                   "--compile.enable", "false"]))
    for recipe, gpus in (("llama3_8b", 8), ("qwen3_moe_30b_a3b", 16), ("deepseek_v3_16b", 16), ("gpt_oss_20b", 8)):
        config = str(REPO / "recipes" / f"{recipe}.toml")
        out.append((f"plan {recipe}", ["plan", "--config", config, "--gpus", str(gpus), "--device", "h100",
                                       "--exact", "0", "--budget-seconds", "600"]))
    out.append(("inspect-trace profile", ["inspect-trace", str(work / "traces" / "profile")]))
    out.append(("inspect-trace fr", ["inspect-trace", str(work / "traces" / "fr")]))
    out.append(("inspect-trace fr json", ["inspect-trace", "--json", str(work / "traces" / "fr")]))
    return out


# What a DCP index and titanctl.json hold that differs between two equal saves: DCP's save id (a uuid)
# and the folder it was written in; the index's checksum. metrics.jsonl's measured fields.
MEASURED_METRICS = ("step_time", "memory_gib", "tps", "tflops", "mfu")


def canonical_bytes(path: Path, work: Path) -> bytes:
    """The bytes of a written file that two equal runs agree on (see above); other files as they are."""
    if path.name == ".metadata":  # DCP's index: what it says about the tensors and files, not its save id
        import torch  # noqa: F401  (the index's classes)

        index = pickle.loads(path.read_bytes())  # written by this run
        return repr((index.state_dict_metadata, index.planner_data, sorted(index.storage_data.items(), key=repr),
                     index.version)).encode()
    if path.name == "titanctl.json":
        meta = json.loads(path.read_text())
        checksums = meta.get("checksums") or {}
        if ".metadata" in checksums.get("files", {}):
            checksums["files"][".metadata"] = "<the index, compared above>"
        if "fields" in checksums:
            checksums["fields"] = "<covers the index's checksum>"
        return mask(json.dumps(meta), work).encode()
    if path.name == "metrics.jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        kept = [{k: v for k, v in row.items() if k not in MEASURED_METRICS} for row in rows]
        return "\n".join(map(json.dumps, kept)).encode()
    if path.suffix in (".json", ".toml", ".jsonl", ".txt"):
        return path.read_text().replace(str(work), "<work>").replace(str(REPO), "<repo>").encode()
    return path.read_bytes()


def file_digests(work: Path) -> dict[str, str]:
    return {str(path.relative_to(work)): hashlib.sha256(canonical_bytes(path, work)).hexdigest()
            for path in sorted(work.rglob("*")) if path.is_file()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="Scratch folder (emptied first); default: a temporary one.")
    parser.add_argument("--show", action="store_true", help="Print every command's masked output too.")
    parser.add_argument("--only", nargs="*", default=None, help="Run only the commands whose label starts so.")
    opts = parser.parse_args()
    work = opts.work or Path(tempfile.mkdtemp(prefix="titanctl-digest-"))
    shutil.rmtree(work, ignore_errors=True)
    (work / "traces").mkdir(parents=True)
    hand_built_traces(work / "traces")
    hf_home = Path(tempfile.mkdtemp(prefix="titanctl-digest-hf-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TIKTOKEN_CACHE_DIR": "", "HF_HOME": str(hf_home), "COLUMNS": "200",
           "TITANCTL_CACHE_DIR": str(hf_home / "cache"), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    everything = hashlib.sha256()
    failed = 0
    for label, argv in commands(work):
        if opts.only is not None and not any(label.startswith(o) for o in opts.only):
            continue
        proc = subprocess.run([sys.executable, "-m", "titanctl", *argv], env=env, cwd=work, capture_output=True,
                              text=True)
        text = mask(f"exit {proc.returncode}\n{proc.stdout}\n--- stderr\n{proc.stderr}", work)
        digest = hashlib.sha256(text.encode()).hexdigest()
        everything.update(f"{label}\0{digest}\n".encode())
        print(f"command {digest[:16]}  {label}  (exit {proc.returncode})", flush=True)
        failed += proc.returncode != 0
        if opts.show or proc.returncode:
            print("    " + text.replace("\n", "\n    "))
    for name, digest in file_digests(work).items():
        everything.update(f"{name}\0{digest}\n".encode())
        print(f"file    {digest[:16]}  {name}")
    shutil.rmtree(hf_home, ignore_errors=True)
    print(f"behaviour digest {everything.hexdigest()}  ({failed} command(s) failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
