"""`titanctl infer-tp`: generate text with a model sharded by Tensor Parallel over all ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from titanctl.gc_pauses import heavy_imports


def infer_tp(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(
        ..., "--checkpoint",
        help="Checkpoint folder of any format convert reads (titanctl DCP, Hugging Face, Meta, torchtune, "
        "torchtitan), or a folder of step-N folders (the newest complete one is read).",
    ),
    prompt: str = typer.Option(
        ..., "--prompt",
        help="Text to continue; with --chat, a conversation: a JSON list of {\"role\", \"content\"} messages (or "
        "an object with messages and tools), or text that does not start with [ or { for one user message.",
    ),
    chat: bool = typer.Option(
        False, "--chat",
        help="Answer --prompt as a chat model: render it with the tokenizer's chat template (or "
        "--sft.chat_template_path) and its generation prompt, and stop at the template's end of turn.",
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 is greedy decoding."),
    top_k: int = typer.Option(200, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all)."),
    seed: int | None = typer.Option(
        None, "--seed", min=0, max=2**64 - 1, help="Sampling seed, 0 to 2^64-1 (default: random, printed)."
    ),
    compile: bool | None = typer.Option(
        None, "--compile/--no-compile",
        help="torch.compile the decode step, after the first token (its time is reported apart; inductor's "
        "cache makes later runs faster). Default: compile from --max-new-tokens 64 on, else decode eagerly; a model "
        "with MoE layers always decodes eagerly (its routing runs between graphs), and refuses --compile.",
        show_default=False,
    ),
    config: Path | None = typer.Option(
        None, "--config",
        help="Recipe giving the tokenizer (default: the checkpoint folder's tokenizer.json or tokenizer.model, "
        "else the bundled one), and the model when the checkpoint does not say.",
    ),
    out: Path | None = typer.Option(None, "--out", help="Also write tokens, text and speed as JSON."),
) -> None:
    """Generate text with a static KV cache, Tensor Parallel over every rank (alone or under torchrun).

    Extra --section.key VALUE options override the recipe (e.g. --model.tokenizer_path); one that
    infer-tp does not read (e.g. --parallelism.tensor_parallel_degree: the degree is the world size) is an error.
    """
    from titanctl.config.recipe import check_overrides

    check_overrides("infer-tp", ctx.args)  # before torch is imported and any checkpoint is looked at
    from rich.console import Console

    console = Console(highlight=False, emoji=False)
    rank0 = os.environ.get("RANK", "0") == "0"

    def say(text: str) -> None:  # progress of the phases that may take seconds, as they start
        console.print(f"infer-tp: {text}", style="dim", markup=False, soft_wrap=True)
        console.file.flush()

    if rank0:
        say("importing torch...")
    with heavy_imports():
        from titanctl.inference.generate import run

    report = run(
        checkpoint, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
        config=config, overrides=ctx.args, compile=compile, say=say, chat=chat,
    )
    if report.rank != 0:
        return
    _print(console, report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.as_dict(), indent=1))


def _print(console, report) -> None:
    from titanctl.safe_io import shown

    result, sampling = report.generation, report.sampling
    # Prompt and generated text as they are, but an escape sequence a token decodes to is not obeyed.
    console.print(f"[dim]{shown(report.prompt, True)}[/dim]{shown(report.text, True)}", soft_wrap=True)
    decode_tps = result.decode_tokens_per_second
    how = "greedy" if sampling.greedy else (
        f"temperature {sampling.temperature:g}, top-k {sampling.top_k or 'off'}, seed {report.seed}")
    step = "compiled" if report.compiled else "eager"
    compiled = f"; compiled in {result.compile_seconds:.1f} s, not counted" if result.compile_seconds else ""
    threads = result.threads
    on = "" if not threads else (
        f", {threads['decode']} thread(s)" if threads["prefill"] == threads["decode"]
        else f", {threads['prefill']} / {threads['decode']} threads")
    console.print(
        f"[bold]{len(result.tokens)} tokens in {result.prefill_seconds + result.decode_seconds:.3f} s: "
        f"{result.tokens_per_second:.1f} tokens/s[/bold] (prefill of {len(result.prompt_tokens)} tokens "
        f"{1000 * result.prefill_seconds:.1f} ms, {result.prefill_tokens_per_second:.0f} tokens/s; {step} decode "
        f"{'-' if decode_tps is None else f'{decode_tps:.1f}'} tokens/s{compiled}), "
        f"tensor parallel {report.tensor_parallel_degree}{on}, {how}, "
        f"stopped by {result.stop_reason.replace('_', ' ')}",
        soft_wrap=True,
    )
