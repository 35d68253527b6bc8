"""Check titanctl's torchtitan format against the real torchtitan 0.3.0, both ways (a manual check,
not part of `make test`: the test suite writes torchtitan's layout itself and never imports torchtitan).

Setup: a scratch venv that borrows titanctl's torch from its venv (nothing is installed into that
one). torchtitan imports triton at module level; the triton wheel imports without a GPU.

    python3.11 -m venv /tmp/ttv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ttv/lib/python3.11/site-packages/titanctl_venv.pth
    /tmp/ttv/bin/pip install --no-deps torchtitan==0.3.0 torchdata tyro docstring_parser einops \
        spmd_types==0.2.3 torch_checkpointing triton

Then, from the repository root, train a debug checkpoint and check it (PYTHONPATH: this checkout's
titanctl, whatever the borrowed venv's editable install points at):

    .venv/bin/python -m titanctl train --config recipes/llama3_debug.toml --training.steps 5 \
        --training.seq_len 64 --training.local_batch_size 2 --checkpoint.enable_checkpoint \
        --checkpoint.interval 5 --job.dump_folder /tmp/run [--model.n_kv_heads 16]
    PYTHONPATH=. /tmp/ttv/bin/python scripts/check_torchtitan_interop.py /tmp/run/checkpoint/step-5

``--model.n_kv_heads 16`` makes the model torchtitan's own debugmodel (multi-head attention);
without it, titanctl's debugmodel (4 key/value heads) is checked.

1. titanctl -> torchtitan: ``titanctl convert STEP TT --to torchtitan``; torchtitan's own
   ``CheckpointManager`` (``initial_load_path`` TT, model only) loads it into torchtitan's own
   ``Llama3Model`` built at the same shape; both models' logits on the same tokens are compared.
2. torchtitan -> titanctl: that torchtitan model takes one step of torchtitan's AdamW (on random
   gradients: its FlexAttention has no backward on CPU), torchtitan's
   ``CheckpointManager`` saves a full training checkpoint (step 1: model, optimizer, lr_scheduler,
   dataloader, train_state) and a model-only last step (step 2); titanctl converts each (to dcp and
   to hf) and titanctl's model on the converted weights is compared with torchtitan's logits.

Prints max |Δlogit| (fp32) of each; exits 1 when one exceeds --tol.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.llama3 import llama3_configs

from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.llama.args import ModelArgs
from titanctl.models.llama.model import Transformer


def torchtitan_model(args: ModelArgs) -> torch.nn.Module:
    """torchtitan 0.3's Llama 3 debugmodel config, set to titanctl's model's depth, vocabulary and key/value
    heads, built and initialised as torchtitan builds it."""
    config = llama3_configs["debugmodel"](attn_backend="flex")
    first = config.layers[0].attention
    assert (config.dim, first.n_heads, first.rope.theta) == (args.dim, args.n_heads, args.rope_theta), "not one shape"
    assert first.rope.scaling == "llama" and args.rope_scaling is not None
    config.vocab_size = args.vocab_size
    config.tok_embeddings = dataclasses.replace(config.tok_embeddings, num_embeddings=args.vocab_size)
    config.lm_head = dataclasses.replace(config.lm_head, out_features=args.vocab_size)
    config.layers = config.layers[: args.n_layers]
    if args.kv_heads != (first.n_kv_heads or first.n_heads):
        for layer in config.layers:
            layer.attention = make_gqa_config(
                dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.kv_heads,
                wqkv_param_init={"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)},
                wo_param_init=layer.attention.wo.param_init, inner_attention=layer.attention.inner_attention,
                rope=layer.attention.rope, fuse_qkv=True,
            )
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def torchtitan_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, model.get_attention_masks(positions))


def titanctl_logits(state: dict[str, torch.Tensor], args: ModelArgs, tokens: torch.Tensor) -> torch.Tensor:
    model = Transformer(args).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


class TrainState(Stateful):
    """What torchtitan's trainer checkpoints as train_state."""

    def __init__(self, step: int, ntokens_seen: int) -> None:
        self.step, self.ntokens_seen = step, ntokens_seen

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def manager(model, optimizers, lr_schedulers, base: Path, **config) -> CheckpointManager:
    return CheckpointManager.Config(enable=True, keep_latest_k=0, **config).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": TrainState(0, 0)}, sd_adapter=None, base_folder=str(base),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", type=Path, help="a titanctl checkpoint step folder")
    parser.add_argument("--tol", type=float, default=1e-5)
    opts = parser.parse_args()
    torch.manual_seed(0)
    results: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tt-interop-") as tmp:
        root = Path(tmp)
        state, args = load_checkpoint(opts.step)
        state = {k: v.float() for k, v in state.items()}
        tok = Tokenizer()
        text = " ".join(doc for _, doc in zip(range(8), load_documents("bundled_val", None)))
        ids = tok.encode(text, bos=True, eos=False)[: 4 * 65]
        tokens = torch.tensor(ids).view(4, 65)
        print(f"{opts.step}: {args.n_layers} layers, dim {args.dim}, n_heads {args.n_heads}, "
              f"n_kv_heads {args.kv_heads}, vocab {args.vocab_size}; tokens {tuple(tokens.shape)}")

        # 1. titanctl -> torchtitan, loaded by torchtitan's CheckpointManager as an initial_load_path, model only.
        export = root / "exported_torchtitan"
        convert_checkpoint(opts.step, export, dst_format="torchtitan", dtype="fp32")
        model = torchtitan_model(args).eval()
        ours = titanctl_logits(state, args, tokens[:, :-1])
        with torch.no_grad():
            fresh = torchtitan_logits(model, tokens[:, :-1])
        print(f"  (torchtitan's freshly initialised model: max |Δlogit| {(fresh - ours).abs().max().item():.3g})")
        optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
        loader = manager(model, optimizers, lr_schedulers, root / "tt_run",
                         initial_load_path=str(export), initial_load_model_only=True)
        assert loader.load(), "torchtitan's CheckpointManager loaded nothing"
        loader.close()
        with torch.no_grad():
            theirs = torchtitan_logits(model, tokens[:, :-1])
        results.append(("titanctl step -> torchtitan export -> torchtitan CheckpointManager + Llama3Model",
                        (theirs - ours).abs().max().item()))

        # 2. torchtitan -> titanctl: one step of torchtitan's AdamW, then its full and model-only saves. The
        # gradients are random: torchtitan's FlexAttention has no backward on CPU.
        gen = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=gen)
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        with torch.no_grad():
            before, theirs = theirs, torchtitan_logits(model, tokens[:, :-1])
        print(f"  (the AdamW step moved torchtitan's logits by up to {(theirs - before).abs().max().item():.3g})")
        saver = manager(model, optimizers, lr_schedulers, root / "tt_run", interval=1, last_save_model_only=True)
        saver.save(curr_step=1)  # full training checkpoint
        saver.save(curr_step=2, last_step=True)  # model only, as torchtitan's last step
        saver.close()
        for step, kind in ((1, "full"), (2, "model-only")):
            folder = root / "tt_run" / "checkpoint" / f"step-{step}"
            for fmt in ("dcp", "hf"):
                report = convert_checkpoint(folder, root / f"from_tt_{step}_{fmt}", dst_format=fmt)
                back, back_args = load_checkpoint(root / f"from_tt_{step}_{fmt}")
                assert back_args.kv_heads == args.kv_heads and back_args.n_layers == args.n_layers, report.origin
                ours = titanctl_logits(back, back_args, tokens[:, :-1])
                results.append((f"torchtitan {kind} save (step {step}) -> titanctl convert --to {fmt} -> titanctl",
                                (theirs - ours).abs().max().item()))
                if fmt == "dcp":
                    print(f"  torchtitan step-{step}: model from {report.origin}; notes: {'; '.join(report.notes)}")
    worst = 0.0
    for what, delta in results:
        print(f"  max |Δlogit| {delta:.3g}  {what}")
        worst = max(worst, delta)
    print(f"{'ok' if worst <= opts.tol else 'FAILED'}: worst {worst:.3g} (tolerance {opts.tol:g})")
    return 0 if worst <= opts.tol else 1


if __name__ == "__main__":
    sys.exit(main())
