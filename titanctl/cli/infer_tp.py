"""`titanctl infer-tp`: generate text with a model sharded by Tensor Parallel over all ranks."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import typer


def infer_tp(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="DCP step folder, folder of step-N folders, or Hugging Face folder."
    ),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 is greedy decoding."),
    top_k: int = typer.Option(200, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all)."),
    seed: int | None = typer.Option(
        None, "--seed", min=0, max=2**64 - 1, help="Sampling seed, 0 to 2^64-1 (default: random, printed)."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="Recipe giving the tokenizer, and the model when the checkpoint does not say."
    ),
    out: Path | None = typer.Option(None, "--out", help="Also write tokens, text and speed as JSON."),
) -> None:
    """Generate text with a KV cache, Tensor Parallel over every rank (alone or under torchrun).

    Extra --section.key VALUE options override the recipe (e.g. --model.tokenizer_path).
    """
    from titanctl.config.loader import load_config
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from titanctl.errors import CheckpointError
    from titanctl.tools import generate as gen

    cfg = load_config(config, ctx.args)
    tokenizer = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    source = gen.find_checkpoint(checkpoint)
    args = source.args
    if args is None:
        if config is None:
            raise CheckpointError(
                f"{source.folder} has no titanctl.json: pass --config RECIPE to say which model it holds"
            )
        from titanctl.models.llama import model_args_from_config

        args = model_args_from_config(cfg.model, tokenizer.vocab_size, cfg.training.seq_len)
    gen.check_vocab(args, tokenizer.vocab_size, tokenizer.path)
    prompt_ids = tokenizer.encode(prompt, bos=True, eos=False)
    args = args.replace(max_seq_len=len(prompt_ids) + max_new_tokens)  # the RoPE table and KV cache length
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    gen.check_tp_degree(args, tp)

    from titanctl.parallel.env import init_process

    env = init_process(cfg.comm.init_timeout_seconds)
    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(env.device.type, (tp,), mesh_dim_names=("tp",))
    model = gen.build_model(args, env.device, mesh)
    gen.load_weights(model, source)
    seed = secrets.randbelow(2**31) if seed is None else seed
    result = gen.generate(
        model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
        stop_tokens=tokenizer.stop_tokens, group=mesh.get_group() if mesh is not None else None,
    )
    if env.rank != 0:
        return
    text = tokenizer.decode([t for t in result.tokens if t not in tokenizer.stop_tokens])
    _report(result, text, prompt, checkpoint, source, tp, temperature, top_k, seed, out)


def _report(result, text, prompt, checkpoint, source, tp, temperature, top_k, seed, out) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[dim]{escape(prompt)}[/dim]{escape(text)}", soft_wrap=True)
    decode_tps = result.decode_tokens_per_second
    sampling = "greedy" if temperature <= 0 else f"temperature {temperature:g}, top-k {top_k or 'off'}, seed {seed}"
    console.print(
        f"[bold]{len(result.tokens)} tokens in {result.prefill_seconds + result.decode_seconds:.3f} s: "
        f"{result.tokens_per_second:.1f} tokens/s[/bold] (prefill of {len(result.prompt_tokens)} tokens "
        f"{1000 * result.prefill_seconds:.1f} ms, decode "
        f"{'-' if decode_tps is None else f'{decode_tps:.1f}'} tokens/s), tensor parallel {tp}, {sampling}, "
        f"stopped by {result.stop_reason.replace('_', ' ')}",
        soft_wrap=True,
    )
    if out is not None:
        data = {
            "tokens": result.tokens,
            "text": text,
            "tokens_per_second": result.tokens_per_second,
            "decode_tokens_per_second": decode_tps,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "prompt": prompt,
            "prompt_tokens": result.prompt_tokens,
            "stop_reason": result.stop_reason,
            "temperature": temperature,
            "top_k": top_k,
            "seed": seed,
            "tensor_parallel_degree": tp,
            "checkpoint": str(checkpoint),
            "checkpoint_format": source.describe(),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
