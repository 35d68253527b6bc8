"""DeepSeek-V3's multi-token prediction (model.mtp_layers): the loss the step adds equals a direct
computation of it; every weight learns from it; layouts that cannot carry it are refused in one line;
its weights take the official checkpoint's names (``model.layers.{n_layers + k}.*``), whose copies of
the shared embedding and output layer are skipped, and a config that declares depths it does not store
(as transformers writes DeepSeek-V3's) reads as none."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.unit.hf_reference import unit_scale_
from tests.unit.parallel.test_parallel_dims import dims
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.checkpoint.hf.names import from_hf_state_dict, hf_config, to_hf_state_dict
from titanctl.errors import CheckpointError, ConfigError, ParallelError
from titanctl.models.common.decoder import Transformer
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titanctl.models.registry import build_model, get_spec
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.loss import cross_entropy_loss
from titanctl.train.step import ForwardBackward

ARGS = DEEPSEEK_V3_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=300, max_seq_len=32, mtp_layers=2)


def model_of(args=ARGS) -> Transformer:
    torch.manual_seed(0)
    model = build_model(args)
    initialize_weights(model, seed=0)
    with torch.no_grad():  # a trained bias, so that routing is not a tie-break
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape))
    return model


def direct_mtp_loss(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's definition written out on truncated sequences: depth d sees positions 0..T-1-d, takes
    the embedding of token i + d and the depth before's hidden state, and predicts labels[i + d]."""
    n, T = model.args.n_layers, tokens.shape[1]
    rope = model.rope_cache
    h = model.tok_embeddings(tokens)
    for i in range(n):
        h = model.layers[str(i)](h, rope)
    h = model.norm(h)
    losses = []
    for d in range(1, model.args.mtp_layers + 1):
        depth = model.mtp[str(d - 1)]
        ahead = model.tok_embeddings(tokens[:, d:])  # (B, T - d, dim)
        x = depth.eh_proj(torch.cat([depth.enorm(ahead), depth.hnorm(h[:, : T - d])], dim=-1))
        h = depth.norm(model.layers[str(n + d - 1)](x, rope))
        losses.append(F.cross_entropy(model.output(h).flatten(0, 1), labels[:, d:].flatten()))
    return sum(losses) / len(losses)


def test_mtp_loss_equals_a_direct_computation_and_every_weight_learns():
    model = model_of()
    window = torch.randint(0, ARGS.vocab_size, (3, 25), generator=torch.Generator().manual_seed(1))
    tokens, labels = window[:, :-1], window[:, 1:]
    logits, depth_logits = model(tokens, mtp=True)
    assert len(depth_logits) == 2 and torch.equal(logits, model(tokens))  # the main path is unchanged
    step = SimpleNamespace(mean_loss_fn=cross_entropy_loss)
    ours = ForwardBackward.multi_token_loss(step, depth_logits, labels)
    with torch.no_grad():
        want = direct_mtp_loss(model, tokens, labels)
    assert abs(ours.item() - want.item()) <= 1e-5 * want.item(), (ours.item(), want.item())
    (cross_entropy_loss(logits, labels) + 0.3 * ours).backward()
    silent = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent, silent  # the depths' blocks, norms and projections included


def refuses_pipeline_and_context_parallel(cfg, args) -> None:
    """PP 2 and CP 2 refuse one prediction depth (``args.mtp_layers`` 1) in one line."""
    from titanctl.parallel.layouts.build import check_layout

    for layout, what in ((dims(2, pipeline_parallel=2, data_parallel_shard=1), "pipeline_parallel_degree = 2"),
                         (dims(2, context_parallel=2, data_parallel_shard=1), "context_parallel_degree = 2")):
        with pytest.raises(ParallelError, match=rf"model.mtp_layers = 1 \(multi-token prediction\) does not run "
                                                rf"under {what}: .*; set model.mtp_layers = 0") as e:
            check_layout(cfg, layout, args)
        assert "\n" not in str(e.value)


def test_layouts_that_cannot_carry_prediction_depths_are_refused_in_one_line():
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout

    cfg = load_config(None, ["--model.name", "deepseek_v3", "--model.mtp_layers", "1"])
    args = model_args_from_config(cfg.model, 256, 64)
    assert args.mtp_layers == 1
    refuses_pipeline_and_context_parallel(cfg, args)
    check_layout(cfg, dims(2, tensor_parallel=2, data_parallel_shard=1), args)  # TP carries it
    llama = load_config(None, ["--model.mtp_layers", "1"])
    with pytest.raises(ConfigError, match="'model.mtp_layers' = 1 needs model.name = 'deepseek_v3'"):
        model_args_from_config(llama.model, 256, 64)


def test_flops_count_each_depth_block_and_output_pass():
    spec = get_spec("deepseek_v3")
    without = ARGS.replace(mtp_layers=0)
    more = spec.flops_per_token(ARGS, 32) - spec.flops_per_token(without, 32)
    assert more > 2 * 6 * ARGS.dim * ARGS.vocab_size  # two depths: at least two more passes through the output


def test_official_names_round_trip_and_the_shared_copies_are_skipped():
    model = model_of(ARGS.replace(mtp_layers=1))
    ours = model.state_dict()
    theirs = to_hf_state_dict(ours, model.args)
    n = model.args.n_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight", "mlp.experts.0.gate_proj.weight"):
        assert f"model.layers.{n}.{name}" in theirs, name
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in theirs)
    # The release also stores the shared weights with the depth: read from the main model instead.
    theirs[f"model.layers.{n}.embed_tokens.weight"] = torch.zeros_like(ours["tok_embeddings.weight"])
    theirs[f"model.layers.{n}.shared_head.head.weight"] = torch.zeros_like(ours["output.weight"])
    back = from_hf_state_dict(theirs, model.args)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_folder_with_a_depth_converts_and_one_declaring_depths_it_lacks_reads_as_none(tmp_path):
    model = model_of(ARGS.replace(mtp_layers=1))
    unit_scale_(model, torch.Generator().manual_seed(0))
    args = model.args
    for name, with_depth in (("with", True), ("declared_only", False)):
        folder = tmp_path / name
        folder.mkdir()
        config = hf_config(args)
        (folder / "config.json").write_text(json.dumps(config))
        state = to_hf_state_dict(model.state_dict(), args)
        if not with_depth:  # as transformers saves DeepSeek-V3: num_nextn_predict_layers 1, no such weights
            state = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{args.n_layers}.")}
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        assert config["num_nextn_predict_layers"] == 1
        convert_checkpoint(folder, tmp_path / f"{name}_dcp", dst_format="dcp")
        loaded, loaded_args = load_checkpoint(tmp_path / f"{name}_dcp")
        assert loaded_args.mtp_layers == (1 if with_depth else 0)
        want = model.state_dict() if with_depth else build_model(args.replace(mtp_layers=0)).state_dict()
        assert loaded.keys() == want.keys()
        if with_depth:
            assert all(torch.equal(loaded[k], want[k]) for k in want)


@pytest.mark.parametrize("declared", [3, 10**9])
def test_a_config_declaring_more_depths_than_it_stores_is_refused_before_sizing_them(tmp_path, monkeypatch, declared):
    """Issue 47: num_nextn_predict_layers 10^9 beside one stored depth built a model of 10^9 blocks on the
    meta device to count its parameters (no answer, memory past 2 GiB): the stored layers bound it first."""
    import titanctl.checkpoint.trust.model_args as model_args
    from titanctl.checkpoint.weights import find_checkpoint

    model = model_of(ARGS.replace(mtp_layers=1))
    folder = tmp_path / "hf"
    folder.mkdir()
    config = hf_config(model.args)
    config["num_nextn_predict_layers"] = declared
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), model.args).items()},
              str(folder / "model.safetensors"))
    real = model_args.num_params

    def sized(args, *a, **kw):
        assert args.mtp_layers <= 1, f"sized a model of {args.mtp_layers} prediction depths"
        return real(args, *a, **kw)

    monkeypatch.setattr(model_args, "num_params", sized)
    message = (f"declares {declared:,} multi-token-prediction depth\\(s\\) after its 2 layers "
               r"\(DeepSeek-V3's num_nextn_predict_layers\), but the checkpoint holds tensors of 3 layer\(s\)")
    with pytest.raises(CheckpointError, match=message):  # infer-tp's reader
        find_checkpoint(folder)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(folder, tmp_path / "dcp", dst_format="dcp")


def test_a_model_without_depths_loads_a_checkpoint_with_one_and_says_so(tmp_path):
    from titanctl.checkpoint.convert import open_checkpoint
    from titanctl.checkpoint.run.load_into_model import load_source_into

    model = model_of(ARGS.replace(mtp_layers=1))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(model.args)))
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), model.args).items()},
              str(folder / "model.safetensors"))
    plain = build_model(model.args.replace(mtp_layers=0))
    with open_checkpoint(folder, "hf", config=None) as source:
        source.bind(plain.args, "this run's recipe")
        assert any("multi-token-prediction layer 2 not loaded: this model has model.mtp_layers = 0" in note for note in source.notes)
        load_source_into(plain, source)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in plain.state_dict().items())
