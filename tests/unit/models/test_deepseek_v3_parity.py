"""DeepSeek-V3 (model.name = deepseek_v3) equals transformers' DeepseekV3ForCausalLM on the same weights,
read through the family's Hugging Face names: Multi-head Latent Attention (with and without q LoRA,
both RoPE layouts), YaRN, a dense first layer, shared experts and group-limited sigmoid routing with the
expert bias. The router equals transformers' on random scores; Hugging Face state dicts (packed and
per-expert experts) convert to titanctl and back to the per-expert layout bit for bit, and a folder that
save_pretrained wrote comes back from DCP as it was (tensors, names, config.json); the YaRN frequencies equal
transformers'; decoding with the latent cache and document masking equal the plain forward; the debug
flavor trains."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_reference import (
    IDS,
    args_of,
    assert_round_trip_keeps_the_folder,
    max_logit_delta,
    titanctl_model_of,
)
from tests.unit.models.families import DEEPSEEK_V3_VARIANTS, REFERENCES, V3_ROPE, deepseek_v3_config, recipe_in_layout
from tests.unit.trained_model import SEQ, tokens_of, windows
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.checkpoint.hf.names import args_from_hf_config, hf_config
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import CheckpointError
from titanctl.models.common.args import MoEArgs
from titanctl.models.common.document_mask import document_mask
from titanctl.models.common.flops import active_params
from titanctl.models.common.moe import Router
from titanctl.models.common.rope import rope_table, yarn_frequencies, yarn_softmax_factor
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, V3_YARN
from titanctl.models.registry import build_model, get_spec
from titanctl.parallel.layouts.weight_init import initialize_weights

TOL = 1e-4


@pytest.fixture(scope="module", params=list(DEEPSEEK_V3_VARIANTS))
def theirs(request):
    return next(r for r in REFERENCES if r.case == f"deepseek_v3-{request.param}").build()


ours_of, delta = titanctl_model_of, max_logit_delta


def test_every_mechanism_moves_the_logits(theirs):
    """The logits equal transformers' (the conformance suite), and each mechanism matters to them."""
    args = args_of(theirs)
    assert args.family == "deepseek_v3" and args.moe.n_group == 4 and args.moe.first_dense_layers == 1
    assert delta(ours_of(theirs), theirs) <= TOL
    moe = args.moe
    without_groups = args.replace(moe=dataclasses.replace(moe, n_group=1, topk_group=1))
    assert delta(ours_of(theirs, without_groups), theirs) > 0.1
    other_layout = args.replace(rope_layout="halves" if args.rope_layout == "interleaved" else "interleaved")
    assert delta(ours_of(theirs, other_layout), theirs) > 0.1
    if args.yarn is not None:
        plain_softmax = ours_of(theirs)
        for layer in plain_softmax.layers.values():
            layer.attention.softmax_factor = 1.0
        assert delta(plain_softmax, theirs) > 0.1


def test_group_limited_routing_equals_transformers_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = deepseek_v3_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    gen = torch.Generator().manual_seed(0)
    reference = DeepseekV3TopkRouter(config)
    args = MoEArgs(num_experts=16, top_k=3, hidden_dim=32, score_func="sigmoid", norm_topk_prob=True,
                   route_scale=2.5, n_group=4, topk_group=2)
    ours = Router(config.hidden_size, args)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(reference.weight.shape, generator=gen))
        reference.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
        ours.gate.weight.copy_(reference.weight)
        x = torch.randn(512, config.hidden_size, generator=gen)
        logits, experts, weights = ours(x, reference.e_score_correction_bias)
        their_logits, their_weights, their_experts = reference(x)
    # Theirs are unsorted: compare each token's (expert, weight) pairs in expert order.
    order, their_order = experts.argsort(dim=-1), their_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(-1, order), their_experts.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, their_logits)
    # Teeth: the limit to the best groups changed some tokens' experts.
    unlimited = Router(config.hidden_size, dataclasses.replace(args, n_group=1, topk_group=1))
    unlimited.gate.weight.data.copy_(reference.weight)
    _, free_choice, _ = unlimited(x, reference.e_score_correction_bias)
    assert not torch.equal(free_choice.sort(dim=-1).values, experts.sort(dim=-1).values)


def test_the_bias_picks_the_group_and_the_experts_not_their_weights():
    router = Router(8, MoEArgs(num_experts=8, top_k=2, hidden_dim=4, score_func="sigmoid", norm_topk_prob=True,
                               route_scale=2.5, n_group=4, topk_group=1))
    router.gate.weight.data.zero_()  # every score 0.5: the bias alone decides
    bias = torch.tensor([0.49, -0.49, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0])  # expert 0 best, group 2 (experts 4, 5) best
    _, experts, weights = router(torch.randn(3, 8), bias)
    assert experts.sort(dim=-1).values.tolist() == [[4, 5]] * 3
    assert torch.equal(weights, torch.full((3, 2), 0.5 * 2.5))  # unbiased scores, renormalized, scaled


def test_a_folder_declaring_a_prediction_depth_it_does_not_hold_round_trips(theirs, tmp_path):
    """As DeepseekV3Config's default writes it: a depth declared, its weights not saved. It is left
    unread, without a note, and the export declares it again (the conformance suite has the plain folder)."""
    import transformers

    theirs.save_pretrained(tmp_path / "hf", max_shard_size="200KB")  # shards + index, one tensor per expert
    # As DeepseekV3Config's default writes it: a prediction depth declared, its weights not saved.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    report = convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    assert not any("multi-token" in note for note in report.notes), report.notes
    state, args = load_checkpoint(tmp_path / "dcp")  # ModelArgs through titanctl.json: MLA and YaRN included
    assert args == args_of(theirs).replace(max_seq_len=args.max_seq_len, mtp_layers=0)
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    config = assert_round_trip_keeps_the_folder(tmp_path / "hf", tmp_path / "back")
    assert (config["bos_token_id"], config["eos_token_id"], config["num_nextn_predict_layers"]) == (0, 1, 1)
    assert config["max_position_embeddings"] == 4096 * 40 and config["rope_theta"] == 10000.0
    if args.yarn is not None:  # transformers 4.x reads YaRN from rope_scaling only
        yarn = {key: value for key, value in config["rope_parameters"].items() if key != "rope_theta"}
        assert config["rope_scaling"] == {**yarn, "type": "yarn"}
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, theirs(IDS).logits)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 1.0), (0.707, 0.707), (1.0, 0.707), (0.0, 0.0)])
def test_yarn_frequencies_equal_transformers(mscale, mscale_all_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {**V3_ROPE, "mscale": mscale or None, "mscale_all_dim": mscale_all_dim or None}
    config = deepseek_v3_config(qk_rope_head_dim=64, rope_parameters=rope)
    their_freqs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = dataclasses.replace(V3_YARN, mscale=mscale, mscale_all_dim=mscale_all_dim)
    freqs, factor = yarn_frequencies(64, 10000.0, yarn)
    assert torch.equal(freqs, their_freqs) and factor == their_factor
    qk_head_dim = config.qk_nope_head_dim + 64
    assert math.isclose(yarn_softmax_factor(yarn) / math.sqrt(qk_head_dim),
                        yarn_apply_mscale(config.rope_parameters, qk_head_dim**-0.5), rel_tol=1e-12)


def test_the_published_flavor_exports_yarn_that_transformers_reads_to_the_same_table():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    args = DEEPSEEK_V3_FLAVORS["671B"].replace(max_seq_len=256)
    config = hf_config(args)
    assert config["rope_parameters"] == {**V3_ROPE, "type": "yarn"} and config["max_position_embeddings"] == 163840
    rotary = DeepseekV3RotaryEmbedding(transformers.DeepseekV3Config(**config))
    cos, sin = rotary(torch.zeros(1), torch.arange(256)[None])  # (1, T, rope_dim): each pair's angle twice
    table = rope_table(args)  # (T, rope_dim // 2, 2)
    assert torch.equal(table[..., 0], cos[0, :, :32]) and torch.equal(table[..., 1], sin[0, :, :32])
    assert args_from_hf_config(config, max_seq_len=256) == args


def test_published_flavors_have_their_active_parameters_and_flops():
    for flavor, active in (("16B", 2.4e9), ("671B", 37e9)):  # DeepSeek's counts (sizes: the conformance suite)
        args = DEEPSEEK_V3_FLAVORS[flavor]
        assert abs(active_params(args) - active) / active < 0.03, flavor  # outside the embedding lookup
        attention = 6 * args.n_layers * args.n_heads * (192 + 128) * 4096  # scores over 192 wide, values 128
        assert get_spec("deepseek_v3").flops_per_token(args, 4096) == 6 * active_params(args) + attention


def test_softmax_routing_has_no_hf_checkpoint():
    with pytest.raises(CheckpointError, match="scores experts with a sigmoid"):
        hf_config(DEEPSEEK_V3_FLAVORS["16B"])


def test_decoding_with_the_latent_cache_equals_the_whole_forward(theirs):
    model = ours_of(theirs)
    ids = IDS[:1, :24]
    with torch.no_grad():
        whole = model(ids)
        model.setup_kv_cache(32)
        steps = [model(ids[:, :10], input_pos=torch.arange(10))]  # prefill, then one token at a time
        steps += [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(10, 24)]
        model.clear_kv_cache()
    assert (torch.cat(steps, dim=1) - whole).abs().max().item() <= TOL


def test_each_document_of_a_packed_window_computes_as_if_alone(theirs):
    model = ours_of(theirs)
    bos = 1
    window = IDS[:1].clone()
    window[0, 0] = window[0, 20] = bos  # two documents: positions 0-19 and 20-47
    with torch.no_grad():
        packed = model(window, attn_mask=document_mask(window, bos, form="dense"))
        first, second = model(window[:, :20]), model(window[:, 20:])
    assert (packed - torch.cat([first, second], dim=1)).abs().max().item() <= TOL


def test_the_debug_flavor_trains_in_one_process():
    tok = Tokenizer()
    args = DEEPSEEK_V3_FLAVORS["debugmodel"].replace(vocab_size=tok.vocab_size, max_seq_len=SEQ, n_layers=2)
    torch.manual_seed(0)
    model = build_model(args)
    initialize_weights(model, seed=0)
    ids = tokens_of("bundled", 40, tok)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(8):
        batch = windows(ids, 4, gen)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        if not losses[1:]:  # every weight learns, MLA's latents and the router included
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("recipe, world, describe", [
    ("deepseek_v3_debug", 1, "single process"),
    ("deepseek_v3_16b", 8, "dp_shard 8 x (experts: ep 8)"),
    ("deepseek_v3_671b", 512, "pp 8 x dp_shard 64 x (experts: ep 64)"),
])
def test_recipes_load_and_their_layouts_fit_their_gpus(repo, recipe, world, describe):
    cfg, dims, args = recipe_in_layout(repo, recipe, world)
    assert dims.describe() == describe
    assert args.family == "deepseek_v3" and args.vocab_size == max(4352, DEEPSEEK_V3_FLAVORS[cfg.model.flavor].vocab_size)
