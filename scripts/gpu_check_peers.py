"""What scripts/gpu_check.py measures beside titanctl: transformers on the same shapes and weights.

- ``training_step``: ``LlamaForCausalLM`` built from titanctl's config.json for the slice (``hf_config``),
  its weights initialized on the device by transformers, eager, under the same autocast, with titanctl's
  AdamW (fused), clipping and loss; tokens/s timed over whole steps with the device synchronized, and
  TFLOP/s and MFU with titanctl's own FLOPs per token and peak (the Trainer's formula).
- ``generation``: ``generate()`` (greedy, its dynamic cache) on infer-tp's prompt ids, decode tokens/s
  apart from the prefill as infer-tp reports them; its tokens against infer-tp's; and the logits
  transformers computes from the Hugging Face export against titanctl's from the checkpoint it came from.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from gpu_check_steps import StepFailed

STEPS = {"cuda": (2, 8), "cpu": (1, 3)}  # (warm-up, timed) training steps, by device
LOGITS_TOLERANCE = 1e-3  # fp32 on both sides (TF32 off): GPU kernels differ from each other by ~1e-6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step(ctx, slice_args: list[str]) -> dict:
    import transformers

    from titanctl.checkpoint.hf.names import hf_config
    from titanctl.config.recipe import load_config
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from titanctl.models.registry import model_args_from_config
    from titanctl.train.flops import flops_per_token
    from titanctl.train.loss import cross_entropy_loss
    from titanctl.train.optim import build_optimizer
    from titanctl.train.peak import device_peak_tflops

    cfg = load_config(ctx.repo / slice_args[1], slice_args[2:])
    t = cfg.training
    device = torch.device(ctx.device)
    vocab = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH).vocab_size
    args = model_args_from_config(cfg.model, vocab, t.seq_len)
    config = transformers.AutoConfig.for_model(**hf_config(args))
    config._attn_implementation = "sdpa"
    with device:
        model = transformers.LlamaForCausalLM(config)
    optimizer = build_optimizer([model], cfg.optimizer)
    dtype = getattr(torch, t.mixed_precision_param)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    tokens = torch.randint(0, vocab, (t.local_batch_size, t.seq_len + 1), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with autocast:
            loss = cross_entropy_loss(model(input_ids=inputs).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warmup, timed = STEPS[device.type]
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(timed):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / timed
    tps = t.local_batch_size * t.seq_len / seconds
    tflops = tps * flops_per_token(args, t.seq_len) / 1e12
    peak = device_peak_tflops(device, dtype, cfg.metrics.peak_tflops)  # the Trainer's peak and MFU
    out = {"tps": round(tps, 1), "tflops": round(tflops, 4), "step_seconds": round(seconds, 5),
           "mfu": round(tflops / peak, 4) if peak and tflops <= peak else None,
           "transformers": transformers.__version__, "attention": config._attn_implementation, "timed_steps": timed}
    if device.type == "cuda":
        out["memory_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return out


class _Clock:
    """A generate() streamer: put() gets the prompt, then each new token; the second mark ends the prefill."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def put(self, value) -> None:
        _sync(self.device)
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass


def generation(ctx, checkpoint: Path, hf: Path, ours: dict) -> dict:
    import transformers

    from titanctl.data.tokenizer import Tokenizer
    from titanctl.inference.generate import find_checkpoint, load_model

    device = torch.device(ctx.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products on both sides (torch's default, made sure)
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).to(device).eval()
    prompt = torch.tensor([ours["prompt_tokens"]], device=device)
    stops = sorted(Tokenizer(hf).stop_tokens)  # where infer-tp stops too
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=len(ours["tokens"]), pad_token_id=0,
                                           eos_token_id=stops)
    with torch.no_grad():
        theirs.generate(prompt, generation_config=transformers.GenerationConfig(
            do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=stops))  # warm-up
        clock = _Clock(device)
        start = time.perf_counter()
        generated = theirs.generate(prompt, generation_config=config, streamer=clock)
        _sync(device)
        end = time.perf_counter()
    tokens = generated[0, prompt.shape[1]:].tolist()
    decode = (len(tokens) - 1) / (end - clock.marks[1])
    out = {"generate_decode_tokens_per_second": round(decode, 1),
           "generate_prefill_seconds": round(clock.marks[1] - start, 4),
           "decode_speedup": round(ours["decode_tokens_per_second"] / decode, 3)
           if ours["decode_tokens_per_second"] else None,
           "tokens_equal": tokens == ours["tokens"]}
    # Logits of the prompt and the generated tokens: titanctl from its own checkpoint, transformers from the export.
    ids = torch.tensor([ours["prompt_tokens"] + ours["tokens"]], device=device)
    source = find_checkpoint(checkpoint)
    model = load_model(source, source.args.replace(max_seq_len=ids.shape[1]), device)
    with torch.no_grad():
        difference = (model(ids) - theirs(ids).logits).abs().max().item()
    out["max_abs_logit_difference"] = difference
    if not difference <= LOGITS_TOLERANCE:
        raise StepFailed(f"transformers' logits from the export differ from titanctl's by {difference:.3g} "
                         f"(more than {LOGITS_TOLERANCE:g})")
    if not out["tokens_equal"]:
        raise StepFailed("greedy tokens differ between infer-tp and transformers' generate()")
    return out
