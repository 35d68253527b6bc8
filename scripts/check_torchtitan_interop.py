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
        --checkpoint.interval 5 --job.dump_folder /tmp/run --model.flavor debugmodel_torchtitan \
        [--model.n_kv_heads 4]
    PYTHONPATH=. /tmp/ttv/bin/python scripts/check_torchtitan_interop.py /tmp/run/checkpoint/step-5

Flavor ``debugmodel_torchtitan`` is torchtitan's own debugmodel (16 heads of 16, multi-head attention);
``--model.n_kv_heads 4`` makes it grouped-query. (titanctl's ``debugmodel``, 8 heads of 32, is not a
shape of torchtitan's debugmodel config, which this script builds: it stops at "not one shape".)

1. titanctl -> torchtitan: ``titanctl convert STEP TT --to torchtitan``; torchtitan's own
   ``CheckpointManager`` (``initial_load_path`` TT, model only) loads it into torchtitan's own
   ``Llama3Model`` built at the same shape; both models' logits on the same tokens are compared.
2. torchtitan -> titanctl: that torchtitan model takes one step of torchtitan's AdamW (on random
   gradients: its FlexAttention has no backward on CPU), torchtitan's
   ``CheckpointManager`` saves a full training checkpoint (step 1: model, optimizer, lr_scheduler,
   dataloader, train_state) and a model-only last step (step 2); titanctl converts each (to dcp and
   to hf) and titanctl's model on the converted weights is compared with torchtitan's logits.

Qwen3, Qwen3-MoE and DeepSeek-V3 (no training run needed; repeat --family, with or without STEP):

    PYTHONPATH=. /tmp/ttv/bin/python scripts/check_torchtitan_interop.py --family qwen3 \
        --family qwen3_moe --family deepseek_v3

builds titanctl's debugmodel of the family at 2 layers (DeepSeek-V3: 3, one of them dense, and one
multi-token prediction depth) with random unit-scale weights, and torchtitan 0.3's own model at that
shape from its own layer builders. The same two directions as above, with two more checks: every
tensor equal bit for bit after each crossing, and torchtitan's saves (which hold no config) read back
with ``--config recipes/<family>_debug.toml --model.n_layers N``. torchtitan's grouped experts compute
in bf16 (~5e-3 in the logits): they run in fp32 here. Its DeepSeek-V3 norms default to eps 1e-5: set to
the model's. A prediction depth reads the main model's hidden state before the final norm in torchtitan,
after it in titanctl: its logits are compared with that norm's weight at ones, where the two agree.

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
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.llama3 import llama3_configs

from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, save_state_dict
from titanctl.checkpoint.formats.torchtitan import canonical_names
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.registry import get_spec


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


def check_llama(step: Path, root: Path) -> list[tuple[str, float]]:
    """A trained titanctl Llama checkpoint both ways: (what was checked, max |Δlogit|) each."""
    results: list[tuple[str, float]] = []
    state, args = load_checkpoint(step)
    state = {k: v.float() for k, v in state.items()}
    tok = Tokenizer()
    text = " ".join(doc for _, doc in zip(range(8), load_documents("bundled_val", None)))
    ids = tok.encode(text, bos=True, eos=False)[: 4 * 65]
    tokens = torch.tensor(ids).view(4, 65)
    print(f"{step}: {args.n_layers} layers, dim {args.dim}, n_heads {args.n_heads}, "
          f"n_kv_heads {args.kv_heads}, vocab {args.vocab_size}; tokens {tuple(tokens.shape)}")

    # 1. titanctl -> torchtitan, loaded by torchtitan's CheckpointManager as an initial_load_path, model only.
    export = root / "exported_torchtitan"
    convert_checkpoint(step, export, dst_format="torchtitan", dtype="fp32")
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
    for saved, kind in ((1, "full"), (2, "model-only")):
        folder = root / "tt_run" / "checkpoint" / f"step-{saved}"
        for fmt in ("dcp", "hf"):
            report = convert_checkpoint(folder, root / f"from_tt_{saved}_{fmt}", dst_format=fmt)
            back, back_args = load_checkpoint(root / f"from_tt_{saved}_{fmt}")
            assert back_args.kv_heads == args.kv_heads and back_args.n_layers == args.n_layers, report.origin
            ours = titanctl_logits(back, back_args, tokens[:, :-1])
            results.append((f"torchtitan {kind} save (step {saved}) -> titanctl convert --to {fmt} -> titanctl",
                            (theirs - ours).abs().max().item()))
            if fmt == "dcp":
                print(f"  torchtitan step-{saved}: model from {report.origin}; notes: {'; '.join(report.notes)}")
    return results


# Qwen3, Qwen3-MoE and DeepSeek-V3 (--family): titanctl's debugmodel flavor at a few layers, with its recipe
# and the layer count that --config plus an override must give to read torchtitan's own saves back.
FAMILY_CHECKS = {  # family -> (recipe, main layers, prediction depths)
    "qwen3": ("recipes/qwen3_debug.toml", 2, 0),  # tied embeddings, QK norm, head width 32
    "qwen3_moe": ("recipes/qwen3_moe_debug.toml", 2, 0),
    "deepseek_v3": ("recipes/deepseek_v3_debug.toml", 3, 1),  # one dense layer, two MoE, one MTP depth
}
FAMILY_VOCAB, FAMILY_SEQ = 512, 64


def unit_scale(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Load random unit-scale weights (std 1/sqrt(fan_in), embedding std 1, norms about 1, an expert bias
    that moves routing): logits far from flat, so a wrong name or layout cannot pass unseen."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=gen)
        if tensor.dim() >= 2:
            state[name] = noise * (1.0 if "tok_embeddings" in name else tensor.shape[-1] ** -0.5)
        else:
            state[name] = 0.1 * noise + (0.0 if name.endswith("expert_bias") else 1.0)
    model.load_state_dict(state)
    model.tie_weights()  # a tied output layer is the embedding, whichever of the two loaded last
    return model.state_dict()


def fp32_grouped_experts(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3's GroupedExperts.forward in fp32 (its own casts to bf16, ~5e-3 off in the logits):
    the same three grouped GEMMs on its w1_EFD, w3_EFD, w2_EDF."""
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, self.w1_EFD.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, self.w3_EFD.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offsets)


def torchtitan_family_model(args: ModelArgs) -> torch.nn.Module:
    """torchtitan 0.3's own model of the family at titanctl's shape, built with its own layer builders."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    vocab, dim = args.vocab_size, args.dim
    if args.family in ("qwen3", "qwen3_moe"):
        import torchtitan.models.qwen3 as tt
        from torchtitan.models.qwen3.model import Qwen3Model

        rope = CosSinRoPE.Config(dim=args.head_dim, max_seq_len=FAMILY_SEQ, theta=args.rope_theta)
        shape = dict(n_layers=args.n_layers, dim=dim, n_heads=args.n_heads, n_kv_heads=args.kv_heads,
                     head_dim=args.head_dim, attn_backend="flex", rope=rope)
        if args.moe is None:
            layers = tt._build_qwen3_layers(**shape, hidden_dim=args.ffn_hidden_dim)
        else:
            layers = tt._build_qwen3_moe_layers(**shape, moe_hidden_dim=args.moe.hidden_dim,
                                                num_experts=args.moe.num_experts, top_k=args.moe.top_k,
                                                moe_comm_backend="standard")
        config = Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=tt._qwen3_norm(dim), enable_weight_tying=args.tie_embeddings,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._LINEAR_INIT), layers=layers,
        )
    else:
        import torchtitan.models.deepseek_v3 as tt
        from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

        mla, moe, yarn = args.mla, args.moe, args.yarn
        rope = ComplexRoPE.Config(dim=mla.qk_rope_head_dim, max_seq_len=FAMILY_SEQ, theta=args.rope_theta,
                                  scaling="yarn", rope_factor=yarn.factor, beta_fast=yarn.beta_fast,
                                  beta_slow=yarn.beta_slow, original_seq_len=yarn.original_max_position_embeddings)
        groups = moe.n_group > 1
        layers = tt._build_dsv3_layers(
            n_layers=args.n_layers, n_dense_layers=moe.first_dense_layers, dim=dim, n_heads=args.n_heads,
            q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, mscale=yarn.mscale_all_dim,
            dense_hidden_dim=args.ffn_hidden_dim, moe_hidden_dim=moe.hidden_dim, num_experts=moe.num_experts,
            num_shared_experts=moe.num_shared_experts, router_top_k=moe.top_k, router_score_func=moe.score_func,
            router_num_expert_groups=moe.n_group if groups else None,
            router_num_limited_groups=moe.topk_group if groups else None, router_route_scale=moe.route_scale,
            router_route_norm=moe.norm_topk_prob, attn_backend="flex", moe_comm_backend="standard",
            non_blocking_capacity_factor=None, rope=rope,
        )
        config = DeepSeekV3Model.Config(
            vocab_size=vocab, dim=dim, norm=RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)),
            layers=layers, mtp_layers=tt._build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=args.mtp_layers),
        )
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for module in model.modules():  # torchtitan's DeepSeek-V3 norms default to eps 1e-5, the release's is 1e-6
        if isinstance(module, torch.nn.RMSNorm):
            module.eps = args.norm_eps
    return model


def family_logits(model: torch.nn.Module, tokens: torch.Tensor, torchtitan: bool) -> list[torch.Tensor]:
    """The next-token logits, then each prediction depth's."""
    with torch.no_grad():
        if torchtitan:
            out = torchtitan_logits(model, tokens)
            return out if isinstance(out, list) else [out]
        out = model(tokens, mtp=model.args.mtp_layers > 0)
        return [out[0], *out[1]] if isinstance(out, tuple) else [out]


def bit_equal(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(tensors equal bit for bit, titanctl's tensors): torchtitan's state dict by its canonical names."""
    canonical = canonical_names(list(theirs))
    by_name = {canonical[k]: v for k, v in theirs.items()}
    same = sum(name in by_name and torch.equal(by_name[name], tensor) for name, tensor in ours.items())
    return same, len(ours)


def check_family(family: str, root: Path) -> list[tuple[str, float]]:
    """A tiny random titanctl model of ``family`` both ways; torchtitan's own saves come back through
    --config with the family's recipe and --model.n_layers (torchtitan saves no config)."""
    recipe, n_layers, depths = FAMILY_CHECKS[family]
    args = get_spec(family).flavors["debugmodel"].replace(n_layers=n_layers, mtp_layers=depths,
                                                          vocab_size=FAMILY_VOCAB, max_seq_len=FAMILY_SEQ)
    GroupedExperts.forward = fp32_grouped_experts
    results: list[tuple[str, float]] = []
    ours_model = Transformer(args).eval()
    state = unit_scale(ours_model, seed=0)
    save_state_dict(state, args, root / "titanctl")
    tokens = torch.randint(0, FAMILY_VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    ours = family_logits(ours_model, tokens, torchtitan=False)
    print(f"{family}: {n_layers} layers (+{depths} prediction depths), dim {args.dim}, vocab {args.vocab_size}; "
          f"|logits| up to {ours[0].abs().max().item():.3g}")

    # 1. titanctl -> torchtitan: the CheckpointManager loads the export model-only, as an initial_load_path.
    export = root / "exported_torchtitan"
    convert_checkpoint(root / "titanctl", export, dst_format="torchtitan")
    model = torchtitan_family_model(args).eval()
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
    loader = manager(model, optimizers, lr_schedulers, root / "tt_run",
                     initial_load_path=str(export), initial_load_model_only=True)
    assert loader.load(), "torchtitan's CheckpointManager loaded nothing"
    loader.close()
    same, total = bit_equal(model.state_dict(), state)
    print(f"  titanctl -> torchtitan: {same}/{total} tensors equal bit for bit after torchtitan loaded them")
    assert same == total
    theirs = family_logits(model, tokens, torchtitan=True)
    results.append((f"{family}: titanctl -> torchtitan export -> torchtitan CheckpointManager + its model",
                    (theirs[0] - ours[0]).abs().max().item()))
    if depths:
        # A depth's hnorm reads the main model's hidden state after its final norm in titanctl (as DeepSeek's
        # release and transformers), before it in torchtitan 0.3, and torchtitan masks the positions whose
        # token ahead lies beyond the window (titanctl wraps them). RMSNorm ignores scale, so with the final
        # norm's weight at ones both inputs are the same: then the depths must agree but for their last positions.
        print(f"  (prediction depth 1 as loaded: max |Δlogit| {(theirs[1] - ours[1]).abs().max().item():.3g})")
        with torch.no_grad():
            model.norm.weight.fill_(1.0)
            ours_model.norm.weight.fill_(1.0)
        ours, theirs = family_logits(ours_model, tokens, False), family_logits(model, tokens, True)
        for depth in range(1, len(ours)):
            results.append((f"{family}: prediction depth {depth}, final norm at ones, all but the last {depth} "
                            "positions", (theirs[depth] - ours[depth])[:, :-depth].abs().max().item()))

    # 2. torchtitan -> titanctl: one AdamW step (random gradients), torchtitan's full and model-only saves.
    gen = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=gen) if param.requires_grad else None
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()
    theirs = family_logits(model, tokens, torchtitan=True)
    saver = manager(model, optimizers, lr_schedulers, root / "tt_run", interval=1, last_save_model_only=True)
    saver.save(curr_step=1)
    saver.save(curr_step=2, last_step=True)
    saver.close()
    overrides = ["--model.n_layers", str(n_layers)] + (["--model.mtp_layers", str(depths)] if depths else [])
    for saved, kind in ((1, "full"), (2, "model-only")):
        folder = root / "tt_run" / "checkpoint" / f"step-{saved}"
        report = convert_checkpoint(folder, root / f"from_tt_{saved}", config=recipe, overrides=overrides)
        back, back_args = load_checkpoint(root / f"from_tt_{saved}")
        same, total = bit_equal(model.state_dict(), back)
        print(f"  torchtitan step-{saved} -> titanctl: {same}/{total} equal bit for bit; model from {report.origin}; "
              f"notes: {'; '.join(report.notes)}")
        assert same == total
        mine = Transformer(back_args).eval()
        mine.load_state_dict(back, strict=not back_args.tie_embeddings)
        mine.tie_weights()
        results.append((f"{family}: torchtitan {kind} save (step {saved}) -> titanctl convert --config {recipe} "
                        f"{' '.join(overrides)} -> titanctl", (theirs[0] - family_logits(mine, tokens, False)[0])
                        .abs().max().item()))
    return results

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", type=Path, nargs="?", help="a titanctl Llama checkpoint step folder")
    parser.add_argument("--family", action="append", choices=sorted(FAMILY_CHECKS), default=[],
                        help="also check this family on a tiny random model (repeatable)")
    parser.add_argument("--tol", type=float, default=1e-5)
    opts = parser.parse_args()
    if opts.step is None and not opts.family:
        parser.error("give a Llama checkpoint step folder, or --family")
    torch.manual_seed(0)
    results: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tt-interop-") as tmp:
        root = Path(tmp)
        if opts.step is not None:
            results += check_llama(opts.step, root / "llama3")
        for family in opts.family:
            results += check_family(family, root / family)
    worst = 0.0
    for what, delta in results:
        print(f"  max |Δlogit| {delta:.3g}  {what}")
        worst = max(worst, delta)
    print(f"{'ok' if worst <= opts.tol else 'FAILED'}: worst {worst:.3g} (tolerance {opts.tol:g})")
    return 0 if worst <= opts.tol else 1


if __name__ == "__main__":
    sys.exit(main())
