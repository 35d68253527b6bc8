"""DeepSeek-V4's multi-token prediction (model.mtp_layers): each depth's logits equal DeepSeek's MTPBlock
written out here from its definition (the V4 release's inference/model.py, read in the Hub mirror
github.com/Nicooo-Wang/DeepSeek-V4-Pro-code at 0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb, ``MTPBlock.forward``
and ``ParallelHead.hc_head``), the step's loss and every gradient equal those of that definition, the
depth's block is the release's (sliding-window attention, score-routed MoE), and the layouts that cannot
carry the depths are refused in one line as for DeepSeek-V3."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.unit.models.families import deepseek_v4_fp64
from tests.unit.models.test_multi_token_prediction import refuses_pipeline_and_context_parallel
from tests.unit.parallel.test_parallel_dims import dims
from titanctl.config.recipe import load_config
from titanctl.errors import ParallelError
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, DeepseekV4Args
from titanctl.models.deepseek_v4.model import DeepseekV4
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.build import check_layout
from titanctl.train.loss import IGNORE_INDEX
from titanctl.train.step import ForwardBackward

ARGS = DeepseekV4Args(
    vocab_size=64, dim=32, n_layers=3, n_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, sliding_window=8, layer_types=(CSA, HCA, SLIDING), compress_rates={CSA: 2, HCA: 4},
    index_n_heads=2, index_head_dim=8, index_topk=3, hc_mult=2, num_experts=4, top_k=2, moe_hidden_dim=16,
    mlp_layer_types=("hash_moe", "moe", "moe"), mtp_layers=2)
SEQ = 24  # beyond the window of 8; the CSA layer's indexer keeps 3 of 12 entries


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The step's mean cross-entropy, in the model's fp64 (the step's own upcasts bf16 to fp32)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def model_and_window():
    model = deepseek_v4_fp64(ARGS)
    return model, torch.randint(0, ARGS.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else weight * x


def reference_depth_logits(model: DeepseekV4, tokens: torch.Tensor) -> list[torch.Tensor]:
    """MTPBlock on truncated sequences: depth d sees positions 0..T-1-d, e = enorm(embed(token i + d)),
    x = e_proj(e) added to every stream of h_proj(hnorm(streams)), the depth's block, then the head: the
    streams collapsed by sigmoid(mix * scale + base) + hc_eps (mix of the flattened streams over their RMS),
    the depth's norm and the shared output layer. Depth 1 takes the main model's last block's streams."""
    eps, hc_eps, n, T = ARGS.norm_eps, ARGS.hc_eps, ARGS.n_layers, tokens.shape[1]
    emb, out = model.tok_embeddings.weight, model.output.weight
    streams = emb[tokens].unsqueeze(2).repeat(1, 1, ARGS.hc_mult, 1)
    for i in range(n):
        streams = model.layers[str(i)](streams, tokens)
    logits = []
    for d in range(1, ARGS.mtp_layers + 1):
        depth, ahead = model.mtp[str(d - 1)], tokens[:, d:]
        e = rms(emb[ahead], depth.enorm.weight, eps)
        x = rms(streams[:, : T - d], depth.hnorm.weight, eps)
        x = (e @ depth.e_proj.weight.T).unsqueeze(2) + x @ depth.h_proj.weight.T
        streams = model.layers[str(n + d - 1)](x, ahead)
        flat = streams.flatten(2)
        mixes = (flat @ depth.hc_head.fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * depth.hc_head.scale + depth.hc_head.base) + hc_eps
        y = (pre.unsqueeze(-1) * streams).sum(dim=2)
        logits.append(rms(y, depth.norm.weight, eps) @ out.T)
    return logits


def test_depth_logits_loss_and_gradients_equal_the_release_definition():
    model, window = model_and_window()
    tokens, labels = window[:, :-1], window[:, 1:]
    logits, depth_logits = model(tokens, mtp=True)
    assert torch.equal(logits, model(tokens))  # the main path is unchanged
    want = reference_depth_logits(model, tokens)
    for d, (ours, theirs) in enumerate(zip(depth_logits, want, strict=True), start=1):
        assert (ours[:, : SEQ - d] - theirs).abs().max() <= 1e-9, d
    step = SimpleNamespace(mean_loss_fn=mean_loss)
    mtp_loss = ForwardBackward.multi_token_loss(step, depth_logits, labels)
    direct = sum(F.cross_entropy(t.flatten(0, 1), labels[:, d:].flatten()) for d, t in enumerate(want, 1)) / 2
    assert abs(mtp_loss.item() - direct.item()) <= 1e-12 * direct.item()
    (mean_loss(logits, labels) + 0.3 * mtp_loss).backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    (mean_loss(model(tokens), labels) + 0.3 * direct).backward()
    theirs = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k], theirs[k], rtol=1e-9, atol=1e-12) for k in ours)
    depth_params = [k for k, _ in model.named_parameters() if k.startswith(("mtp.", f"layers.{ARGS.n_layers}."))]
    silent = [k for k in depth_params if k not in ours or not ours[k].abs().sum() > 0]
    assert depth_params and not silent, silent  # e_proj, h_proj, norms, hc_head and the depth's block learn


def test_the_depths_blocks_are_the_releases_and_the_main_schedule_is_unchanged():
    """The release's compress_ratios give its MTP layer 0 (sliding window: no compressor, no indexer)."""
    model, _ = model_and_window()
    assert sorted(model.layers, key=int) == ["0", "1", "2", "3", "4"]
    for k in ("3", "4"):
        block = model.layers[k]
        assert block.self_attn.kind == SLIDING and not block.mlp.hashed
        assert not hasattr(block.self_attn, "compressor") or block.self_attn.compressor is None
    assert [model.layers[str(i)].self_attn.kind for i in range(3)] == [CSA, HCA, SLIDING]
    assert model.layers["0"].mlp.hashed


def test_the_key_reaches_the_model_and_layouts_that_cannot_carry_it_are_refused():
    cfg = load_config(None, ["--model.name", "deepseek_v4", "--model.mtp_layers", "1"])
    args = model_args_from_config(cfg.model, 256, 64)
    assert args.mtp_layers == 1
    with torch.device("meta"):
        model = DeepseekV4(ARGS.__class__(**{**vars(ARGS), "mtp_layers": 0}))
    assert model.mtp is None
    refuses_pipeline_and_context_parallel(cfg, args)
    # Its TP plan does not place the depths' own norms and projections (DeepSeek-V3's does)
    with pytest.raises(ParallelError, match=r"model.mtp_layers = 1 \(multi-token prediction\) does not run under "
                                            r"tensor_parallel_degree = 2 for deepseek_v4 yet .*; set model.mtp_layers = 0"):
        check_layout(cfg, dims(2, tensor_parallel=2, data_parallel_shard=1), args)


def test_a_folder_with_a_depth_converts_to_dcp_and_back_bit_for_bit(tmp_path):
    """save_pretrained's layout (DeepSeek's names; transformers builds no depth): depth 0's block is
    model.layers.{n_layers}.* beside its own e_proj, h_proj, norms and hc_head_*; config.json declares it
    (num_nextn_predict_layers 1); HF -> DCP loads it into the model, DCP -> HF writes the folder back."""
    import json

    from safetensors.torch import load_file, save_file

    from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
    from titanctl.checkpoint.hf.names import from_hf_state_dict, hf_config, to_hf_state_dict
    from titanctl.models.registry import build_model, get_spec

    args = get_spec("deepseek_v4").flavors["debugmodel"].replace(vocab_size=64, max_seq_len=64, mtp_layers=1)
    torch.manual_seed(0)
    model = build_model(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.init_buffers("cpu")
    ours = model.state_dict()
    theirs = to_hf_state_dict(ours, args)
    n = args.n_layers
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                 "hc_head_base", "hc_head_scale", "attn.wq_a.weight", "hc_attn_fn", "ffn.experts.0.w1.weight"):
        assert f"model.layers.{n}.{name}" in theirs, name
    assert not any(k.startswith(("mtp.", f"model.layers.{n + 1}.")) for k in theirs)
    back = from_hf_state_dict(theirs, args)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    folder = tmp_path / "hf"
    folder.mkdir()
    config = hf_config(args)
    assert config["num_nextn_predict_layers"] == 1
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in theirs.items()}, str(folder / "model.safetensors"))
    convert_checkpoint(folder, tmp_path / "dcp", dst_format="dcp")
    loaded, loaded_args = load_checkpoint(tmp_path / "dcp")
    assert loaded_args.mtp_layers == 1
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    written, stored = load_file(tmp_path / "back" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert written.keys() == stored.keys() and all(torch.equal(written[k], stored[k]) for k in stored)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@torch.no_grad()
def test_decoding_caches_only_the_main_layers_and_equals_one_forward():
    """Decoding runs the main layers only: the depths' blocks get no cache (they would hold memory for nothing),
    and a prompt then tokens through the caches give the whole forward's logits."""
    model, window = model_and_window()
    ids = window[:1, :SEQ]
    model.setup_kv_cache(SEQ)
    try:
        cached = sorted(k for k, block in model.layers.items() if block.self_attn.cache is not None)
        assert cached == [str(i) for i in range(ARGS.n_layers)]
        pieces = [model(ids[:, a:b], input_pos=torch.arange(a, b)) for a, b in ((0, 20), *((i, i + 1) for i in
                                                                                          range(20, SEQ)))]
        assert (torch.cat(pieces, dim=1) - model(ids)).abs().max() <= 1e-9
    finally:
        model.clear_kv_cache()


def test_flops_per_token_counts_the_depths_attention_and_output_pass():
    """Each depth adds its block and projections (6 x their active parameters), its sliding window's scores
    and values (12 x heads x head_dim x window) and its logits through the shared output layer (6 x dim x
    vocab), as DeepSeek-V3's count does."""
    from titanctl.models.registry import build_model, get_spec

    spec = get_spec("deepseek_v4")
    base = spec.flavors["debugmodel"].replace(vocab_size=256, max_seq_len=256)
    depths = base.replace(mtp_layers=2)
    with torch.device("meta"):
        model = build_model(depths)
    moe, n = depths.moe, depths.n_layers
    added = sum(p.numel() * moe.top_k // moe.num_experts if ".mlp.experts." in name else p.numel()
                for name, p in model.named_parameters() if name.startswith(("mtp.", f"layers.{n}.", f"layers.{n + 1}.")))
    window = min(depths.sliding_window, 256)
    want = (spec.flops_per_token(base, 256) + 6 * (added + 2 * depths.dim * depths.vocab_size)
            + 12 * depths.n_heads * depths.head_dim * 2 * window)
    assert spec.flops_per_token(depths, 256) == want
