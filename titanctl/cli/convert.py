"""`titanctl convert-checkpoint` (alias `titanctl convert`)."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.cli import console
from titanctl.gc_pauses import heavy_imports


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def convert(
    ctx: typer.Context,
    # readable=False: titanctl checks SRC itself and says what is wrong in one line.
    src: Path = typer.Argument(..., readable=False, help="Checkpoint folder to read."),
    dst: Path = typer.Argument(..., help="Folder to write: must not exist, or be empty."),
    from_format: str | None = typer.Option(
        None, "--from",
        help="Source format: meta, dcp, hf, torchtune or torchtitan, or peft (an adapter folder, read onto "
        "--lora-base into a titanctl LoRA checkpoint). Default: told by SRC's files.",
    ),
    to_format: str | None = typer.Option(
        None, "--to",
        help="Target format: meta, dcp, hf, torchtune or torchtitan, or peft (a LoRA step's adapters, for peft). "
        "Default: dcp, or hf when SRC is dcp.",
    ),
    flavor: str | None = typer.Option(
        None, "--flavor", help="Model flavor (debugmodel, 8B, 70B, 405B) instead of SRC's own config."
    ),
    config: Path | None = typer.Option(
        None, "--config",
        help="Recipe TOML whose model section to use instead; --section.key VALUE options override it "
        "(e.g. --model.n_layers 2).",
    ),
    dtype: str | None = typer.Option(
        None, "--dtype",
        help="Cast weights: fp32, bf16 or fp16. Default: keep (block-quantized FP8 weights, as DeepSeek-V3's, "
        "are dequantized to bf16).",
    ),
    shards: int | None = typer.Option(None, "--shards", help="Model-parallel shards of a meta output."),
    max_shard_size: str | None = typer.Option(
        None, "--max-shard-size", help="Largest safetensors file of an hf output, e.g. 5GB (the default)."
    ),
    merge_lora: bool = typer.Option(
        False, "--merge-lora",
        help="SRC is a LoRA run's step (adapters only): write its base with the adapters folded in "
        "(W + alpha / rank x B A), in any --to format. The base is the one the step records, checked by its "
        "fingerprint.",
    ),
    lora_base: Path | None = typer.Option(
        None, "--lora-base", readable=False,
        help="Where the LoRA step's base is now, when it moved (its weights must be the ones the adapters were "
        "trained on): for --merge-lora and --to peft, which both check the base and name it in peft's config; "
        "with --from peft, the model the adapter was made for (a titanctl step, or a Hugging Face, torchtitan, "
        "Meta or torchtune folder).",
    ),
    drop_expert_bias: bool = typer.Option(
        False, "--drop-expert-bias",
        help="Export to a format that has no slot for the MoE expert bias that moe.load_balance_coeff trains "
        "(Hugging Face's Qwen3-MoE and gpt-oss; peft, for a LoRA step whose bias moved) without it: the export then "
        "routes tokens as with a zero bias (peft: the base's). Without the flag such an export is refused.",
    ),
    text_only: bool = typer.Option(
        False, "--text-only",
        help="Of a vision-language folder (the Hub's Qwen3.5: its vision encoder and multi-token-prediction head "
        "carried unchanged through titanctl), write an hf output of the text model alone: its *ForCausalLM "
        "config.json under the folder's names, which transformers' *ForCausalLM loads. Default: the whole folder.",
    ),
    tokenizer_path: Path | None = typer.Option(
        None,
        "--tokenizer-path",
        help="Tokenizer (tiktoken tokenizer.model or tokenizer.json) for the tokenizer files of an hf or torchtune "
        "output, recorded in a dcp output. Default: the one SRC records, else the bundled one if its vocabulary fits.",
    ),
) -> None:
    """Convert checkpoints between Meta, DCP, Hugging Face, torchtune and torchtitan formats; export a LoRA
    run's adapters for peft (--to peft) or merged into their base (--merge-lora); read a peft adapter onto
    its base (--from peft --lora-base BASE).

    Extra --section.key VALUE options override the --config recipe: the model's shape (model.name, flavor,
    n_layers, n_kv_heads, mtp_layers, norm_type) and training.seq_len; any other key is an error.
    """
    from titanctl.config.recipe import check_overrides

    check_overrides("convert", ctx.args)  # before torch is imported and any checkpoint is looked at
    with heavy_imports():
        from titanctl.checkpoint.convert import WARNING, ConversionReport, convert_checkpoint
    from titanctl.safe_io import visible

    bar = console.ByteProgress()
    try:
        report: ConversionReport = convert_checkpoint(
            src,
            dst,
            src_format=from_format,
            dst_format=to_format,
            flavor=flavor,
            config=config,
            overrides=ctx.args,
            dtype=dtype,
            shards=shards,
            max_shard_size=max_shard_size,
            progress=bar,
            tokenizer_path=tokenizer_path,
            merge_lora=merge_lora,
            lora_base=lora_base,
            drop_expert_bias=drop_expert_bias,
            text_only=text_only,
        )
    except KeyboardInterrupt:
        bar.stop()
        console.error(f"interrupted; {dst} was left as it was (nothing was written there)")
        raise typer.Exit(130) from None
    finally:
        bar.stop()
    args = report.args
    typer.echo(
        f"{report.src_format} → {report.dst_format}: {report.tensors} tensors, {_size(report.nbytes)} "
        f"in {report.seconds:.1f} s ({args.n_layers} layers, dim {args.dim}, vocab {args.vocab_size}, "
        f"model from {visible(str(report.origin))}) → {visible(str(report.dst))}"
    )
    for note in report.notes:
        typer.echo(f"  {'' if note.startswith(WARNING) else 'note: '}{visible(note)}")
