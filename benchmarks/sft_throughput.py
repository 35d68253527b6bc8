"""Tokens/s of titanctl's chat fine-tuning step vs. trl's ``SFTTrainer``, full SFT and LoRA, on CPU.

titanctl's step is built as ``titanctl train`` builds it from recipes/qwen3_debug_sft.toml: the
``chat:bundled`` conversations rendered with the bundled tokenizer's chat template and packed whole
into windows (first-fit decreasing), block-causal attention with positions restarting at each
conversation, the loss over the assistant tokens (``ForwardBackward`` with chat microbatches, the
recipe's compile and linear-kernel settings, gradient clipping, AdamW and its LR schedule). For
LoRA the same setup takes recipes/qwen3_debug_lora.toml's ``[lora]`` section (rank, alpha, dropout,
targets); its optimizer stays the SFT recipe's.

trl runs its own training loop, ``SFTTrainer.train()`` unchanged, on the same windows: the benchmark
packs the conversations once with titanctl's packer and hands trl each window as a pre-tokenized
example (``input_ids``; ``labels``, -100 except on assistant tokens, unshifted as transformers wants
them; ``seq_lengths``, the conversations' lengths in the window, the padding after the last one
counted as one more). With ``padding_free=True`` trl's collator flattens each batch into one row of
batch x seq_len tokens with ``position_ids`` restarting at every conversation and no attention
mask; transformers 5.23 on CPU (``sdpa``, the default, or ``eager``) then finds the packed
sequences from the position_ids (``masking_utils.find_packed_sequence_indices``) and builds a dense
block-causal mask over that row. So packing is respected without flash-attention, but each row's
attention spans all batch x seq_len tokens under the mask where titanctl's spans seq_len (the same
masked-out pairs, computed and thrown away: batch times the attention work). This is what
``SFTTrainer`` does on CPU with ``packing=True`` (its ``bfd`` strategy turns padding-free on).
``--trl-rows`` instead gives trl one row per window, titanctl's shape: trl's collator with position_ids
and without the all-ones attention mask it adds (with a mask, transformers ignores the packing in the
position_ids); no trl setting does this, and it shows what the flattening costs. The loss is trl's
own: its fused LM head projects only the positions that have a label (the assistant tokens) onto the
vocabulary, where titanctl projects every position. trl's defaults that would change the work are set
to the recipe's: no gradient checkpointing (trl's default is on), fp32 (trl's default is bf16), no
shuffling, the windows in the order titanctl's loader draws them.

Same model (Qwen3 debugmodel), same weights (titanctl's random initialization, not the recipe's base
checkpoint, copied into transformers' ``Qwen3ForCausalLM``; for LoRA titanctl's adapters too, into
peft's through titanctl's peft export), same optimizer (torch's AdamW with the recipe's kernel, fused,
lr, betas, eps and weight decay 0, so transformers' sparing of norms and biases from decay changes
nothing), same gradient clipping (max_norm), same batch and sequence length, fp32, same threads. The
LR schedules are each tool's own (titanctl's warmup + cosine; transformers' ``cosine`` with the same
warmup), which changes no step's work. Tokens/s counts every window token (batch x seq_len per step,
the padding after the last conversation included) for both.

The first step's loss of each (same weights, same batch, before any update) must agree within
``--loss-rtol`` (default 1e-4 relative): both are printed after that step, before the timed rounds, and
the benchmark stops if they differ (a mask that let conversations see each other would show there).

The contenders run in alternating rounds, so that load from other processes hits both alike: trl's
loop runs once over all its steps, and a callback at the end of each of its rounds runs titanctl's
round; trl's round is timed from the end of titanctl's previous round to the end of its last step, so
it includes everything trl's loop does per step (collation, metrics). The first step of each is timed
apart (titanctl's includes torch.compile) and one more warm-up step follows; the ratio printed is
the median of the rounds' ratios. ``--isa both`` (the default) runs it all twice in subprocesses, with
this CPU's kernels and as on an AVX2-only CPU, as benchmarks/train_throughput.py does; a floor
(linear FLOPs at this CPU's best product rate plus torch's attention kernel over windows of seq_len;
LoRA's frozen weights count 4 FLOPs per token, having no weight gradient, its adapters none) follows
each ratio.

Install and run (trl is in the ``bench`` extra, pinned in constraints.txt; nothing else changes):

    make install && .venv/bin/pip install -c constraints.txt -e '.[bench]'
    PYTHONPATH=. .venv/bin/python benchmarks/sft_throughput.py [--isa both|native|avx2] [--rounds 5]
        [--steps-per-round 3] [--which full,lora] [--threads 2] [--batch 8] [--seq-len 256]
        [--compile | --no-compile] [--attn sdpa|eager] [--trl-rows] [--loss-rtol 1e-4]
        [--recipe recipes/qwen3_debug_sft.toml] [--lora-recipe recipes/qwen3_debug_lora.toml]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to fetch
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from train_throughput import (  # this folder is on sys.path when run as a script
    ISA_ENV,
    attention_seconds,
    best_gemm_rate,
    cpu_description,
    has_avx512,
    load_average,
)

from titanctl.checkpoint.hf.names import hf_config, to_hf_state_dict
from titanctl.checkpoint.hf.tokenizer_export import hf_tokenizer_json
from titanctl.checkpoint.lora.export import peft_adapter
from titanctl.config.recipe import load_config
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.data.mixture import sources_from_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.registry import model_args_from_config
from titanctl.models.shapes import num_params
from titanctl.parallel.converters.lora import is_adapter
from titanctl.parallel.converters.onednn_linear import linear_kernel
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.reductions import clip_grad_norm
from titanctl.train.loss import IGNORE_INDEX, build_loss_fn
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.optim import build_optimizer
from titanctl.train.step import ForwardBackward

REPO = Path(__file__).resolve().parents[1]
KINDS = {"full": "full SFT", "lora": "LoRA"}
RATIO = re.compile(r"ratio titanctl/trl \((full SFT|LoRA)\) = ([0-9.]+)")
INSTALL = "install trl with: .venv/bin/pip install -c constraints.txt -e '.[bench]'"


def run_per_isa(argv: list[str]) -> None:
    """This benchmark once per ISA in a subprocess (the ISA is fixed when torch loads); prints each
    run's output and then the ratios side by side."""
    isas = ["native", "avx2"] if has_avx512() else ["native"]
    ratios: dict[str, list[str]] = {}
    for isa in isas:
        settings = " ".join(f"{key}={value}" for key, value in ISA_ENV.get(isa, {}).items())
        print(f"--- {isa}" + (f" ({settings})" if settings else ""), flush=True)
        # As train_throughput: each capability gets its own inductor cache folder from titanctl's import.
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("TORCHINDUCTOR_CACHE_DIR", *ISA_ENV["avx2"])}
        path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**inherited, **ISA_ENV.get(isa, {}), "PYTHONPATH": path}
        run = subprocess.run([sys.executable, __file__, *argv, "--isa", isa], env=env, text=True, capture_output=True)
        out = run.stdout
        print(out, end="", flush=True)
        if run.returncode:
            raise SystemExit(f"--isa {isa} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
        ratios[isa] = [f"{kind} {ratio}" for kind, ratio in RATIO.findall(out)]
    if len(isas) == 1:
        print("(no AVX-512 on this CPU: native is the AVX2 path)")
    print("titanctl/trl: " + "; ".join(f"{isa} {', '.join(r)}" for isa, r in ratios.items()))


def titanctl_config(opts, lora: bool):
    """The SFT recipe as ``titanctl train`` reads it, on one process, no checkpoint or validation; with
    ``lora`` the LoRA recipe's [lora] section on top."""
    overrides = ["--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len),
                 "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "1",
                 "--checkpoint.enable_checkpoint", "false", "--checkpoint.initial_load_path", "",
                 "--validation.enabled", "false"]
    if opts.compile is not None:
        overrides += ["--compile.enable", str(opts.compile).lower()]
    cfg = load_config(opts.recipe, overrides)
    if lora:
        cfg.lora = load_config(opts.lora_recipe).lora
    return cfg


def chat_loader(cfg, tokenizer: Tokenizer) -> TokenWindowLoader:
    """The loader ``titanctl train`` builds for the recipe (one data-parallel rank)."""
    return TokenWindowLoader(
        sources_from_config(cfg.training, cfg.sft), tokenizer, seq_len=cfg.training.seq_len,
        global_batch_size=cfg.training.local_batch_size, local_batch_size=cfg.training.local_batch_size,
        dp_rank=0, dp_degree=1, seed=cfg.training.seed, stream_shards=cfg.training.stream_shards,
    )


def titanctl_step(cfg, dims, args, tokenizer: Tokenizer):
    """(model, LoRA conversion or None, step function, first-step loss getter): the Trainer's step."""
    cpu = torch.device("cpu")
    loss_fn = build_loss_fn(cfg, dims.tp)
    built = build_model_parts(cfg, dims, args, cpu, loss_fn=loss_fn)
    forward_backward = ForwardBackward(cfg, dims, built.parts, None, cpu, loss_fn, bos_id=tokenizer.bos_id, chat=True)
    optimizer = build_optimizer(built.parts, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    loader = chat_loader(cfg, tokenizer)
    params = list(built.parts[0].parameters())
    losses = []

    def step():
        losses.append(forward_backward(loader.next_step()))
        clip_grad_norm(params, cfg.training.max_norm, dims)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    return built.parts[0], built.lora, step, losses


def trl_examples(cfg, tokenizer: Tokenizer, steps: int) -> list[dict]:
    """The windows titanctl's loader hands out over ``steps`` steps, in its order, as trl's pre-tokenized
    examples: labels unshifted (transformers shifts them), and the lengths of the conversations in each
    window (the padding after the last is one more: its positions restart too)."""
    loader = chat_loader(cfg, tokenizer)
    examples = []
    for _ in range(steps):
        for inputs, labels, positions in loader.next_step():
            for ids, targets, pos in zip(inputs.tolist(), labels.tolist(), positions.tolist()):
                assert targets[-1] == IGNORE_INDEX  # conversations are never split across windows
                starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
                examples.append({"input_ids": ids, "labels": [IGNORE_INDEX, *targets[:-1]],
                                 "seq_lengths": [b - a for a, b in zip(starts, starts[1:])]})
    return examples


def hf_model(ours: torch.nn.Module, args, attn: str):
    """transformers' Qwen3ForCausalLM with titanctl's base weights (adapters left out)."""
    import transformers

    hf = hf_config(args)
    config = transformers.AutoConfig.for_model(**hf)
    config._attn_implementation = attn
    theirs = getattr(transformers, hf["architectures"][0])(config)
    base = {k: v for k, v in ours.state_dict().items() if not is_adapter(k)}
    missing, unexpected = theirs.load_state_dict(to_hf_state_dict(base, args), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if args.tie_embeddings else set()), missing
    return theirs


def peft_config_and_adapters(ours: torch.nn.Module, lora, args):
    """peft's LoraConfig for titanctl's adapters (same targets, rank, alpha, dropout) and their values."""
    from peft import LoraConfig

    adapters = {k: v.detach() for k, v in ours.state_dict().items() if is_adapter(k)}
    config, tensors = peft_adapter(adapters, args, lora.record())
    keep = {k: v for k, v in config.items() if k not in ("peft_type", "base_model_name_or_path")}
    return LoraConfig(**{**keep, "inference_mode": False}), tensors


def rows_collator(pad_id: int):
    """trl's collator without padding-free: one row per window, position_ids from seq_lengths, and no
    attention mask (with one transformers would not read the packing from the position_ids)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_id, return_position_ids=True)

    def collator(examples: list[dict]) -> dict:
        batch = collate(examples)
        del batch["attention_mask"]
        return batch

    return collator


def trl_trainer(cfg, model, examples: list[dict], tokenizer: Tokenizer, steps: int, folder: str, callback, *,
                rows: bool, peft=None):
    """An SFTTrainer over the pre-packed examples, padding-free (or with ``rows`` one row per window),
    with the recipe's optimizer settings; it records each step's loss in ``losses``."""
    import datasets
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    class RecordingSFTTrainer(SFTTrainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss)  # the step's mean loss, before the update
            return loss

    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    processing = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(hf_tokenizer_json(tokenizer)),
                                         bos_token=names[tokenizer.bos_id], eos_token=names[tokenizer.eos_id],
                                         pad_token=names[pad])
    o = cfg.optimizer
    adamw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    adamw.update({"fused": True} if o.implementation == "fused" else {"foreach": o.implementation == "foreach"})
    sft = SFTConfig(
        output_dir=folder, max_steps=steps, per_device_train_batch_size=cfg.training.local_batch_size,
        gradient_accumulation_steps=1, learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
        adam_beta2=o.beta2, adam_epsilon=o.eps, lr_scheduler_type="cosine",
        warmup_steps=cfg.lr_scheduler.warmup_steps, max_grad_norm=cfg.training.max_norm,
        padding_free=not rows, packing=False, max_length=None, shuffle_dataset=False,
        train_sampling_strategy="sequential", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        seed=cfg.training.seed, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False,
    )
    trainer = RecordingSFTTrainer(
        model=model, args=sft, train_dataset=datasets.Dataset.from_list(examples), processing_class=processing,
        peft_config=peft[0] if peft else None, callbacks=[callback],
        optimizer_cls_and_kwargs=(torch.optim.AdamW, adamw), data_collator=rows_collator(pad) if rows else None,
    )
    trainer.remove_callback(PrinterCallback)  # its closing line of metrics
    trainer.losses = []
    if peft:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(trainer.model, peft[1])
        assert not result.unexpected_keys, result.unexpected_keys
    return trainer


def alternating_callback(ours_step, steps_per_round: int, batch_tokens: int, on_first):
    """A TrainerCallback that times trl's steps and runs titanctl's between trl's rounds: after trl's
    first step titanctl's first (``on_first`` then compares the losses) and a warm-up step each, then
    rounds of ``steps_per_round`` steps, trl's then titanctl's, until trl's max_steps. Its ``first`` and
    ``rates`` hold the first-step seconds and each round's tokens/s."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self):
            self.first: dict[str, float] = {}
            self.rates: dict[str, list[float]] = {"titanctl": [], "trl": []}
            self.started = self.mark = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now, step = time.perf_counter(), state.global_step
            round_end = step > 2 and (step - 2) % steps_per_round == 0
            if step == 1:
                self.first["trl"] = now - self.started
                start = time.perf_counter()
                ours_step()
                self.first["titanctl"] = time.perf_counter() - start
                on_first()
                ours_step()
            elif round_end:
                self.rates["trl"].append(steps_per_round * batch_tokens / (now - self.mark))
                start = time.perf_counter()
                for _ in range(steps_per_round):
                    ours_step()
                self.rates["titanctl"].append(steps_per_round * batch_tokens / (time.perf_counter() - start))
            if step == 2 or round_end:
                self.mark = time.perf_counter()  # trl's next round starts now

    return Alternate()


def floor_line(model: torch.nn.Module, args, batch: int, seq_len: int, flops_per_weight: int, trl_step: float) -> str:
    """The step's linear FLOPs at this CPU's best product rate plus torch's attention kernel over
    windows of seq_len, against trl's step (as train_throughput's floor)."""
    tokens = batch * seq_len
    linear = flops_per_weight * tokens * sum(m.weight.numel() for m in model.modules()
                                             if isinstance(m, torch.nn.Linear))
    linear_s = linear / best_gemm_rate(model, tokens)
    attention_s = attention_seconds(args, batch, seq_len)
    return (f"floor: linears {linear / 1e9:.1f} GFLOP at this CPU's best product rate ({linear / linear_s / 1e9:.0f} "
            f"GFLOP/s) {linear_s * 1e3:.0f} ms + torch's attention kernel {attention_s * 1e3:.0f} ms; trl's step "
            f"{trl_step * 1e3:.0f} ms: a step on torch's attention beats it by at most "
            f"{trl_step / (linear_s + attention_s):.2f}x (nothing else counted)")


def compare(kind: str, opts, dims, args, tokenizer: Tokenizer, folder: str) -> None:
    cfg = titanctl_config(opts, lora=kind == "lora")
    ours, lora, ours_step, ours_losses = titanctl_step(cfg, dims, args, tokenizer)
    theirs = hf_model(ours, args, opts.attn)
    peft = peft_config_and_adapters(ours, lora, args) if lora is not None else None
    steps = 2 + opts.rounds * opts.steps_per_round
    batch_tokens = opts.batch * opts.seq_len
    trainer = None

    def check_first_losses():
        a, b = ours_losses[0].item(), trainer.losses[0].item()
        rel = abs(a - b) / abs(b)
        print(f"{KINDS[kind]}: first-step loss titanctl {a:.7f}, trl {b:.7f} (relative difference {rel:.1e})",
              flush=True)
        if not rel <= opts.loss_rtol:
            raise SystemExit(f"{KINDS[kind]}: first-step losses differ by {rel:.1e} > {opts.loss_rtol:g} relative: "
                             "the two do not compute the same step, so their speeds do not compare")

    timer = alternating_callback(ours_step, opts.steps_per_round, batch_tokens, check_first_losses)
    examples = trl_examples(cfg, tokenizer, steps)
    learned = sum(label != IGNORE_INDEX for e in examples[:opts.batch] for label in e["labels"])
    trainer = trl_trainer(cfg, theirs, examples, tokenizer, steps, folder, timer, rows=opts.trl_rows, peft=peft)
    trainable = {"titanctl": sum(p.numel() for p in ours.parameters() if p.requires_grad),
                 "trl": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}
    if trainable["titanctl"] != trainable["trl"]:
        raise SystemExit(f"{KINDS[kind]}: trainable parameters differ: {trainable}")
    load_before = load_average()
    trainer.train()
    print(f"{KINDS[kind]}: {trainable['trl'] / 1e6:.3g}M trainable parameters; load average {load_before} -> "
          f"{load_average()}; the first batch has {learned:,} learned tokens of {batch_tokens:,}")
    for name in ("titanctl", "trl"):
        rates = timer.rates[name]
        print(f"{name:10s}{statistics.median(rates):10,.0f} tokens/s   first step {timer.first[name]:6.2f} s "
              f"(rounds: {', '.join(f'{r:,.0f}' for r in rates)})")
    ratio = statistics.median(a / b for a, b in zip(timer.rates["titanctl"], timer.rates["trl"]))
    print(f"ratio titanctl/trl ({KINDS[kind]}) = {ratio:.3f}")
    trl_step = batch_tokens / statistics.median(timer.rates["trl"])
    # LoRA: the frozen weights need no weight gradient (4 FLOPs per weight per token; adapters not counted).
    print(floor_line(ours, args, opts.batch, opts.seq_len, 6 if lora is None else 4, trl_step), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/qwen3_debug_sft.toml"))
    parser.add_argument("--lora-recipe", default=str(REPO / "recipes/qwen3_debug_lora.toml"),
                        help="the recipe whose [lora] section LoRA applies to the SFT setup")
    parser.add_argument("--which", default="full,lora", help="full, lora or both (comma-separated)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="titanctl with compile.enable on/off (default: the recipe's)")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers' attention")
    parser.add_argument("--trl-rows", action="store_true",
                        help="give trl one row per window (a collator of our own) instead of its padding-free row")
    parser.add_argument("--loss-rtol", type=float, default=1e-4,
                        help="largest relative difference of the first-step losses")
    parser.add_argument("--isa", default="both", choices=["both", "native", "avx2"],
                        help="kernels of this CPU, of an AVX2-only one (see ISA_ENV), or both in turn")
    opts = parser.parse_args()
    kinds = [k.strip() for k in opts.which.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.exit(2, f"--which {opts.which!r}: choose from {', '.join(KINDS)}\n")
    if opts.isa == "both":
        run_per_isa([a for a in sys.argv[1:] if a not in ("--isa", "both")])
        return
    if opts.isa == "avx2" and any(os.environ.get(k) != v for k, v in ISA_ENV["avx2"].items()):
        parser.exit(2, "--isa avx2 needs its environment before torch loads: run with --isa both\n")
    try:
        import peft
        import transformers
        import trl
    except ImportError as e:
        parser.exit(2, f"{e}; {INSTALL}\n")
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # trl's use of names transformers renamed
    import datasets

    datasets.disable_progress_bars()
    torch.set_num_threads(opts.threads)

    cfg = titanctl_config(opts, lora=False)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    tokenizer = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    args = model_args_from_config(cfg.model, tokenizer.vocab_size, opts.seq_len)
    cpu, bf16_units = cpu_description()
    print(f"CPU {cpu}, {os.cpu_count()} cores, bf16 units: {', '.join(bf16_units) or 'none'}")
    print(f"model {cfg.model.name} {cfg.model.flavor} ({num_params(args) / 1e6:.1f}M params), batch {opts.batch} x "
          f"{opts.seq_len} packed windows of {cfg.training.dataset}, float32, {opts.threads} threads; titanctl: "
          f"compile {'on' if cfg.compile.enable else 'off'}, linear kernel {linear_kernel(cfg.training.cpu_linear)} "
          f"(training.cpu_linear = {cfg.training.cpu_linear}); trl {trl.__version__} (transformers "
          f"{transformers.__version__}, peft {peft.__version__}), attention {opts.attn}, "
          + ("one row per window (--trl-rows)" if opts.trl_rows else "padding-free: each batch one row"))
    print(chat_loader(cfg, tokenizer).notes[0])
    print(f"tokens/s counts every window token: {opts.batch * opts.seq_len:,} per step, for both", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for kind in kinds:
            compare(kind, opts, dims, args, tokenizer, folder)
    if torch.get_num_threads() != opts.threads:
        print(f"warning: torch runs {torch.get_num_threads()} threads now, not {opts.threads}")


if __name__ == "__main__":
    main()
