"""Steps/s of `titanctl rl` against trl's GRPOTrainer on the same tiny model, prompts, group size, lengths and
optimizer, on CPU, printing the ratio.

Both start from one Hugging Face folder: the debug Llama (``--layers`` of its blocks) initialized by titanctl
and exported (weights, tokenizer, chat template), so trl's transformers model and titanctl's model hold the
same weights. Both train GRPO (no KL, one update per rollout, group-scaled advantages, loss over each
completion's tokens) with AdamW at the same learning rate, fp32, on the shipped task's prompts
(``arithmetic``: rendered by each with the tokenizer's chat template), ``--prompts`` prompts x ``--group``
completions of up to ``--tokens`` tokens a step, rewarded by exact match; trl generates with transformers'
``generate()``, titanctl with its own sampler. Each side runs ``--steps`` steps after ``--warmup`` and the
figure is steps over their wall time; the sides alternate ``--rounds`` times (a busy machine slows both alike).

trl runs in a process of its own (so that neither side's imports or threads touch the other's), from the same
environment: it is in the ``bench`` extra, pinned in constraints.txt:

    make install && .venv/bin/pip install -c constraints.txt -e '.[bench]'

Usage: PYTHONPATH=. .venv/bin/python benchmarks/rl_vs_trl.py [--trl-python PATH] [--steps 5] [--layers 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TRL_SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args = json.loads(sys.stdin.read())
    torch.set_num_threads(args["threads"])
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in args["rows"]]

    def exact_match(completions, answer, **kwargs):
        return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]

    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=args["out"], per_device_train_batch_size=args["prompts"] * args["group"],
        gradient_accumulation_steps=1, num_generations=args["group"], max_completion_length=args["tokens"],
        learning_rate=args["lr"], beta=0.0, num_iterations=1, loss_type="grpo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0, max_steps=args["steps"] + args["warmup"], logging_steps=1000,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, dataloader_num_workers=0, shuffle_dataset=True,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,  # titanctl's AdamW defaults
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    steps = ends[args["warmup"]:]
    print(json.dumps({"seconds_per_step": (ends[-1] - ends[args["warmup"] - 1]) / len(steps)}))
''')


def export_model(folder: Path, layers: int) -> Path:
    """The debug Llama with ``layers`` blocks, initialized by titanctl (seed 0), as a Hugging Face folder."""
    from titanctl.checkpoint.convert import convert_checkpoint
    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer

    dump = folder / "init"
    Trainer(load_config("recipes/llama3_debug.toml", [
        "--model.n_layers", str(layers), "--checkpoint.create_seed_checkpoint", "--checkpoint.enable_checkpoint",
        "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump), "--training.seq_len", "64"])).train()
    hf = folder / "hf"
    convert_checkpoint(dump / "checkpoint" / "step-0", hf, dst_format="hf")
    return hf


def titanctl_seconds(hf: Path, args, folder: Path) -> float:
    from titanctl.config.recipe import load_config
    from titanctl.rl.loop import RLTrainer

    cfg = load_config("recipes/llama3_debug_grpo.toml", [
        "--model.n_layers", str(args.layers), "--training.seq_len", "64", "--checkpoint.initial_load_path", str(hf),
        "--checkpoint.enable_checkpoint", "false", "--metrics.enable_tensorboard", "false",
        "--rl.prompts_per_step", str(args.prompts), "--rl.group_size", str(args.group),
        "--rl.max_response_tokens", str(args.tokens), "--training.local_batch_size", str(args.prompts * args.group),
        "--training.steps", str(args.steps + args.warmup), "--optimizer.lr", str(args.lr),
        "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1000", "--job.dump_folder", str(folder)])
    trainer = RLTrainer(cfg)
    trainer.console.quiet = True
    ends, update = [], trainer.update

    def timed(batch):
        out = update(batch)
        ends.append(time.perf_counter())
        return out

    trainer.update = timed
    trainer.train()
    return (ends[-1] - ends[args.warmup - 1]) / args.steps


def trl_seconds(python: Path, hf: Path, args, folder: Path, rows: list[dict]) -> float:
    payload = json.dumps({"model": str(hf), "rows": rows, "prompts": args.prompts, "group": args.group,
                          "tokens": args.tokens, "lr": args.lr, "steps": args.steps, "warmup": args.warmup,
                          "out": str(folder), "threads": args.threads})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": ""}
    proc = subprocess.run([str(python), "-c", TRL_SCRIPT], input=payload, capture_output=True, text=True, env=env,
                          cwd=folder)
    if proc.returncode:
        sys.exit(f"trl failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", type=Path, default=Path(sys.executable), help="a Python with trl 1.16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    args = parser.parse_args()
    probe = subprocess.run([str(args.trl_python), "-c", "import trl"], capture_output=True)
    if probe.returncode:
        sys.exit(f"{args.trl_python} cannot import trl: .venv/bin/pip install -c constraints.txt -e '.[bench]'")
    import torch

    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in gzip.open(REPO / "titanctl/assets/arithmetic/train.jsonl.gz", "rt")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = export_model(root, args.layers)
        ours, theirs = [], []
        for r in range(args.rounds):
            ours.append(titanctl_seconds(hf, args, root / f"titanctl{r}"))
            (root / f"trl{r}").mkdir()
            theirs.append(trl_seconds(args.trl_python, hf, args, root / f"trl{r}", rows))
            print(f"round {r + 1}: titanctl {1 / ours[-1]:.3f} steps/s, trl {1 / theirs[-1]:.3f} steps/s", flush=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"{args.prompts} prompts x {args.group} completions of up to {args.tokens} tokens, {args.layers} layers, "
          f"{args.threads} threads: titanctl rl {1 / o:.3f} steps/s, trl GRPOTrainer {1 / t:.3f} steps/s, "
          f"ratio {t / o:.2f}x")


if __name__ == "__main__":
    main()
