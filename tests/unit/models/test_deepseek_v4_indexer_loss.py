"""The lightning indexer's training: its loss is the KL from the attention's distribution over the compressed
entries (heads summed, normalized) to the indexer's softmax, dense in the warm-up and over the chosen entries
after; it trains the indexer alone (every other gradient is the language model's, unchanged), and a warm-up
step trains nothing but the indexer. The keys reach the model and are refused where they cannot act."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.unit.models.test_deepseek_v4_recipe import RECIPE, VOCAB
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, DeepseekV4Args
from titanctl.models.deepseek_v4.indexer_loss import indexer_kl
from titanctl.models.deepseek_v4.model import DeepseekV4
from titanctl.models.registry import model_args_from_config, with_training_keys

ARGS = DeepseekV4Args(
    vocab_size=64, dim=32, n_layers=3, n_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, sliding_window=8, layer_types=(CSA, HCA, SLIDING), compress_rates={CSA: 2, HCA: 4},
    index_n_heads=2, index_head_dim=8, index_topk=3, hc_mult=2, num_experts=4, top_k=2, moe_hidden_dim=16,
    mlp_layer_types=("moe",) * 3, indexer_loss_coeff=0.5)
SEQ = 32  # 16 CSA entries, of which the indexer keeps 3


def model_and_tokens(args=ARGS):
    torch.manual_seed(0)
    model = DeepseekV4(args).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.init_buffers()
    return model, torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
def test_the_loss_is_the_kl_to_the_attentions_distribution(dense):
    """Recomputed from the layer's own probabilities with torch's kl_div: per query, the target is the heads'
    summed probabilities on the entries (normalized), the student the indexer's softmax over the same entries."""
    model, tokens = model_and_tokens()
    model.v4 = dataclasses.replace(model.v4, indexer_warmup_steps=5)
    model.set_training_step(0 if dense else 10, 1)
    attn = model.layers["0"].self_attn
    seen = {}
    indexer_forward = attn.indexer.forward

    def record(*a):
        seen["keep"], seen["visible"], seen["scores"] = out = indexer_forward(*a)
        return out

    attn.indexer.forward = record
    probs, inside = {}, []
    softmax = torch.Tensor.softmax
    width = (SEQ - 1) + (SEQ - 1) // 2 + 1  # the window's keys (every position), the entries, the sink

    def keep_probs(t, dim=-1, **kw):
        out = softmax(t, dim=dim, **kw)
        if inside and t.shape[-1] == width:  # layer 0's attention probabilities
            probs["p"] = out
        return out

    attn.register_forward_pre_hook(lambda *_: inside.append(1))
    attn.register_forward_hook(lambda *_: inside.clear())
    torch.Tensor.softmax = keep_probs
    try:
        lm_loss(model, tokens)
    finally:
        torch.Tensor.softmax = softmax
    allowed = seen["visible"] if dense else seen["keep"]
    assert (allowed.sum(-1) > 3).any() == dense  # the warm-up spans more than the top-k
    entries = probs["p"][..., SEQ - 1:-1]  # the layer's last softmax: (B, H, S, window keys + entries + sink)
    target = entries.sum(1)
    rows = allowed.any(-1)
    target = target[rows] / target[rows].sum(-1, keepdim=True)
    log_q = seen["scores"].masked_fill(~allowed, float("-inf")).log_softmax(-1)[rows]
    expected = torch.stack([F.kl_div(lq[m], t[m], reduction="sum")
                            for lq, t, m in zip(log_q, target, allowed[rows])]).mean()
    assert torch.allclose(attn.indexer_loss, expected, rtol=1e-10)
    assert torch.allclose(indexer_kl(probs["p"][..., SEQ - 1:-1].sum(1), seen["scores"], allowed), expected, rtol=1e-10)


def test_the_loss_trains_the_indexer_alone():
    """With the loss on, every non-indexer gradient equals the language model's alone exactly, the logged loss
    (the output) is unchanged, and the indexer, which the language model's loss leaves without a gradient,
    gets one."""
    model, tokens = model_and_tokens(dataclasses.replace(ARGS, indexer_loss_coeff=0.0))
    plain = lm_loss(model, tokens)
    plain.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert not any(".indexer." in n for n in plain_grads)
    model.zero_grad(set_to_none=True)
    model.v4 = ARGS
    for block in model.layers.values():
        block.self_attn.indexer_loss_coeff = ARGS.indexer_loss_coeff
    with_loss = lm_loss(model, tokens)
    with_loss.backward()
    assert with_loss.item() == plain.item() and model.last_indexer_loss > 0
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        elif name in plain_grads:
            assert torch.equal(p.grad, plain_grads[name]), name


def test_a_warmup_step_trains_the_indexer_alone():
    """In the warm-up every entry is attended (no top-k) and only the indexer's weights get gradients: an AdamW
    step moves them and nothing else; after the warm-up, sparse attention and every weight trains."""
    model, tokens = model_and_tokens(dataclasses.replace(ARGS, indexer_warmup_steps=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.set_training_step(0, 1)
    lm_loss(model, tokens).backward()
    opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (".indexer." in name), name
    opt.zero_grad(set_to_none=True)
    model.set_training_step(1, 1)
    assert not model.layers["0"].self_attn.dense
    lm_loss(model, tokens).backward()
    assert model.layers["1"].self_attn.q_a_proj.weight.grad is not None


def test_the_keys_reach_the_model_and_are_refused_where_they_cannot_act():
    cfg = load_config(RECIPE, ["--model.indexer_loss_coeff", "0.1", "--model.indexer_warmup_steps", "20"])
    ca = with_training_keys(model_args_from_config(cfg.model, VOCAB, 256), cfg.model).compressed_attention
    assert (ca.indexer_loss_coeff, ca.indexer_warmup_steps) == (0.1, 20)
    with pytest.raises(ConfigError, match="^config key 'model.indexer_warmup_steps' = 20 needs model.indexer_loss"):
        warmup_alone = load_config(RECIPE, ["--model.indexer_warmup_steps", "20"]).model
        with_training_keys(model_args_from_config(warmup_alone, VOCAB, 256), warmup_alone)
    llama = load_config(RECIPE, ["--model.name", "llama3", "--model.indexer_loss_coeff", "0.1"])
    with pytest.raises(ConfigError, match="^config key 'model.indexer_loss_coeff' = 0.1 needs a model with a "):
        with_training_keys(model_args_from_config(llama.model, VOCAB, 256), llama.model)
