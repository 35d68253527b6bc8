"""Checkpoint conversion between meta, dcp, hf and torchtune: bit-identical round trips,
transformers parity, Meta model-parallel shards, trained weights, streaming and errors."""

from __future__ import annotations

import itertools
import json
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.hf_reference import assert_round_trip_keeps_the_folder, unit_scale_
from titanctl.checkpoint import convert as conv
from titanctl.checkpoint.convert import (
    convert_checkpoint,
    load_checkpoint,
    open_checkpoint,
    parse_size,
    save_state_dict,
    write_checkpoint,
)
from titanctl.checkpoint.formats import FORMATS, DictSource, detect
from titanctl.checkpoint.formats.dcp import DCPSource
from titanctl.checkpoint.trust.metadata import read_metadata, write_metadata
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.decoder import Transformer
from titanctl.models.shapes import weight_shapes
from titanctl.parallel.layouts.weight_init import initialize_weights

ARGS = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=512,
    max_seq_len=64,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
)
PAIRS = list(itertools.permutations(FORMATS, 2))
# Meta's model-parallel layout, written out here independently of the implementation.
MP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1, "w2": 1}


def mp_dim(name: str) -> int | None:
    return MP_DIM.get(name.split(".")[-2])


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        import transformers

        yield transformers


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(ARGS)
    initialize_weights(m, seed=0)
    unit_scale_(m)
    return m.eval()


@pytest.fixture(scope="module")
def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sources(state, tmp_path_factory):
    """The tiny model saved once in each format by the format writers."""
    root = tmp_path_factory.mktemp("sources")
    for fmt in FORMATS:
        save_state_dict(state, ARGS, root / fmt, fmt)
    return {fmt: root / fmt for fmt in FORMATS}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def stored_names(folder) -> set[str]:
    """Every tensor name a written folder holds, read without our readers."""
    fmt = detect(folder)
    if fmt == "hf":
        from safetensors import safe_open

        return {k for f in sorted(folder.glob("*.safetensors")) for k in safe_open(str(f), framework="pt").keys()}
    if fmt in ("dcp", "torchtitan"):
        return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    return {k for f in sorted(folder.glob("*.pt*")) + sorted(folder.glob("*.bin")) for k in torch.load(f)}


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def load_model(folder, **kwargs) -> Transformer:
    sd, args = load_checkpoint(folder, **kwargs)
    m = Transformer(args.replace(max_seq_len=64))
    m.load_state_dict(sd, strict=True)
    return m.eval()


# ----------------------------------------------------------------------------- the matrix


def test_formats_are_detected(sources):
    assert {fmt: detect(path) for fmt, path in sources.items()} == {f: f for f in FORMATS}


@pytest.mark.parametrize("src, dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_round_trip_is_bit_identical(src, dst, sources, state, tmp_path):
    there = convert_checkpoint(sources[src], tmp_path / "there", dst_format=dst)
    assert (there.src_format, there.dst_format, there.tensors) == (src, dst, len(state))
    back = convert_checkpoint(tmp_path / "there", tmp_path / "back", dst_format=src)
    assert (back.src_format, back.dst_format) == (dst, src)
    for folder in ("there", "back"):
        sd, args = load_checkpoint(tmp_path / folder)
        assert_same(sd, state)
        assert weight_shapes(args) == weight_shapes(ARGS)
        assert (args.rope_theta, args.rope_scaling, args.norm_eps) == (ARGS.rope_theta, ARGS.rope_scaling, ARGS.norm_eps)
        names = stored_names(tmp_path / folder)
        assert not any("freq" in n or "rope" in n for n in names), names  # never a RoPE buffer
    assert not list(tmp_path.glob(".*partial*"))  # temporary folders renamed away


def test_dtype_cast_round_trips_bit_identically(sources, state, tmp_path):
    convert_checkpoint(sources["meta"], tmp_path / "hf", dst_format="hf", dtype="bf16")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp")
    assert read_metadata(tmp_path / "dcp")["dtype"] == "bfloat16"
    convert_checkpoint(tmp_path / "dcp", tmp_path / "tt", dst_format="torchtune")
    sd, _ = load_checkpoint(tmp_path / "tt")
    assert_same(sd, {k: v.to(torch.bfloat16) for k, v in state.items()})


def test_hf_shards_and_index(sources, state, tmp_path):
    out = tmp_path / "hf"
    convert_checkpoint(sources["dcp"], out, max_shard_size="40KB")  # dcp -> hf by default
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in state.values())
    assert_same(load_checkpoint(out)[0], state)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 kb") == 1500 and parse_size("100") == 100
    with pytest.raises(CheckpointError, match="cannot read size"):
        parse_size("five gigs")


# ----------------------------------------------------------------------------- transformers


@pytest.mark.slow
def test_hf_export_loads_in_transformers_and_matches(model, sources, transformers, tmp_path):
    convert_checkpoint(sources["meta"], tmp_path / "hf", dst_format="hf", max_shard_size="100KB")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    delta = (logits(model, ARGS.vocab_size) - logits(theirs, ARGS.vocab_size)).abs().max().item()
    assert delta <= 1e-4, f"max |Δlogit| = {delta:.3g}"


@pytest.mark.slow
def test_export_without_the_qk_permutation_would_not_match(model, sources, transformers, tmp_path, monkeypatch):
    from titanctl.checkpoint.hf import names as hf_names

    real = hf_names.to_hf_tensor

    def rename_only(name, tensor, args):
        return real(name, tensor, args)[0], tensor

    monkeypatch.setattr(hf_names, "to_hf_tensor", rename_only)
    convert_checkpoint(sources["meta"], tmp_path / "hf", dst_format="hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    delta = (logits(model, ARGS.vocab_size) - logits(theirs, ARGS.vocab_size)).abs().max().item()
    assert delta > 0.1, f"max |Δlogit| = {delta:.3g} without the permutation: the parity test has no teeth"


def test_checkpoint_written_by_transformers_imports_and_matches(transformers, tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config)
    unit_scale_(theirs, torch.Generator().manual_seed(1))
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="150KB")  # several safetensors + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    report = convert_checkpoint(tmp_path / "hf", tmp_path / "dcp")
    assert (report.src_format, report.dst_format, report.origin) == ("hf", "dcp", "config.json")
    ours = load_model(tmp_path / "dcp")
    assert ours.args.ffn_hidden_dim == 200 and ours.args.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 32)
    delta = (logits(ours, 384) - logits(theirs.eval(), 384)).abs().max().item()
    assert delta <= 1e-4, f"max |Δlogit| = {delta:.3g}"
    # And back: the same folder, config.json included (not the 16 x 32 context or the ids Llama 3's
    # vocabulary would give a config written from the model's arguments).
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf", max_shard_size="150KB")
    back = assert_round_trip_keeps_the_folder(tmp_path / "hf", tmp_path / "back")
    assert (back["max_position_embeddings"], back["bos_token_id"], back["eos_token_id"]) == (128, 1, 2)
    # transformers 4.x reads RoPE from rope_theta and rope_scaling only (5.x wrote rope_parameters).
    assert back["rope_theta"] == 50000.0
    assert back["rope_scaling"] == {k: v for k, v in back["rope_parameters"].items() if k != "rope_theta"}


def test_a_carried_config_is_written_only_while_it_describes_the_model():
    from titanctl.checkpoint.hf.carried_config import export_config
    from titanctl.checkpoint.hf.names import hf_config

    source = {**hf_config(ARGS), "max_position_embeddings": 77, "transformers_version": "5.23.0"}
    notes: list[str] = []
    kept = export_config(ARGS, source, dtype="bfloat16", token_ids=None, default_token_ids=(None, None), notes=notes)
    without_version = {k: v for k, v in source.items() if k != "transformers_version"}
    assert kept == {**without_version, "dtype": "bfloat16", "torch_dtype": "bfloat16"} and not notes
    trained = ARGS.replace(rope_theta=1234.0)  # e.g. a run that changed it: the source's config no longer says it
    fresh = export_config(trained, source, dtype="float32", token_ids=None, default_token_ids=(None, None), notes=notes)
    assert fresh == hf_config(trained) and fresh["max_position_embeddings"] != 77
    assert notes == ["config.json written from the model's arguments: the source's config.json, carried in the "
                     "checkpoint, describes another model (its rope_parameters, rope_theta differ)"]


# ----------------------------------------------------------------------------- Meta model-parallel shards


def split_meta(state: dict[str, torch.Tensor], n: int, embedding_dim: int = 0) -> list[dict[str, torch.Tensor]]:
    shards = [{} for _ in range(n)]
    for name, tensor in state.items():
        dim = mp_dim(name)
        if name == "tok_embeddings.weight":
            dim = embedding_dim
        parts = [tensor] * n if dim is None else tensor.chunk(n, dim)
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    return shards


def write_meta(folder, shards, args=ARGS, extra=None):
    folder.mkdir()
    for i, shard in enumerate(shards):
        torch.save({**shard, **(extra or {})}, folder / f"consolidated.{i:02d}.pth")
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
              "vocab_size": args.vocab_size, "multiple_of": args.multiple_of, "norm_eps": args.norm_eps,
              "rope_theta": args.rope_theta, "use_scaled_rope": False}
    (folder / "params.json").write_text(json.dumps(params))
    return folder


def test_two_shard_meta_checkpoint_merges_and_splits_back(state, tmp_path):
    shards = split_meta(state, 2)
    # rope.freqs: a derived buffer that old Meta files carry; skipped, never written.
    src = write_meta(tmp_path / "meta2", shards, extra={"rope.freqs": torch.ones(4)})
    merged, args = load_checkpoint(src)
    assert args.rope_scaling is None  # params.json said use_scaled_rope: false
    assert_same(merged, state)
    convert_checkpoint(src, tmp_path / "dcp")
    assert_same(load_checkpoint(tmp_path / "dcp")[0], state)
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="meta", shards=2)
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == [
        "consolidated.00.pth", "consolidated.01.pth", "params.json"]
    for i, want in enumerate(shards):
        assert_same(torch.load(tmp_path / "back" / f"consolidated.{i:02d}.pth"), want)
    # meta -> meta through the torchtune format keeps the layout too
    convert_checkpoint(src, tmp_path / "tt", dst_format="torchtune")
    convert_checkpoint(tmp_path / "tt", tmp_path / "tt_meta", dst_format="meta", shards=2)
    for i, want in enumerate(shards):
        assert_same(torch.load(tmp_path / "tt_meta" / f"consolidated.{i:02d}.pth"), want)
    assert shards[1]["layers.0.attention.wk.weight"].shape == (8, 64)  # one of the 2 KV heads each


def test_llama2_style_embedding_split_is_read(state, tmp_path):
    src = write_meta(tmp_path / "meta", split_meta(state, 2, embedding_dim=1))
    assert_same(load_checkpoint(src)[0], state)


def test_meta_shard_errors(state, tmp_path):
    with pytest.raises(CheckpointError, match="cannot split 2 KV heads over 4"):
        save_state_dict(state, ARGS, tmp_path / "x", "meta", shards=4)  # 8 heads would split, 2 KV heads not
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*partial*"))
    shards = split_meta(state, 2)
    shards[1]["norm.weight"] = shards[1]["norm.weight"] + 1
    src = write_meta(tmp_path / "bad_norm", shards)
    with pytest.raises(CheckpointError, match="replicated tensor 'norm.weight' differs"):
        load_checkpoint(src)
    shards = split_meta(state, 2)
    shards[1]["layers.0.attention.wq.weight"] = shards[1]["layers.0.attention.wq.weight"][:, :32]
    with pytest.raises(CheckpointError, match=r"'layers.0.attention.wq.weight' has shape \(32, 32\) in consolidated.01"):
        load_checkpoint(write_meta(tmp_path / "bad_shape", shards))
    shards = split_meta(state, 2)
    del shards[1]["output.weight"]
    with pytest.raises(CheckpointError, match="consolidated.00.pth has tensor 'output.weight' that consolidated.01"):
        load_checkpoint(write_meta(tmp_path / "lacking", shards))


# ----------------------------------------------------------------------------- DCP specifics


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_full_training_checkpoint_reads_only_the_model(state, tmp_path):
    folder = tmp_path / "step-7"
    full = {
        **state,
        "optimizer": {"state": {n: {"exp_avg": torch.zeros_like(t), "step": torch.tensor(7.0)} for n, t in state.items()},
                      "param_groups": [{"lr": 1e-3, "params": list(state)}]},
        "lr_scheduler": {"last_epoch": 7},
        "train_state": {"step": 7, "tokens_seen": 1234},
        "dataloader": {"position": 99},
        "rng": {"torch": torch.get_rng_state()},
    }
    dcp.save(full, checkpoint_id=str(folder), no_dist=True)
    write_metadata(folder, ARGS, step=7, weights_only=False, dtype="float32")
    with open_checkpoint(folder) as source:
        assert source.format == "dcp" and len(source.infos) == len(state)
        write_checkpoint(source, tmp_path / "weights", "dcp")
    meta = read_metadata(tmp_path / "weights")
    assert meta["step"] == 7 and meta["weights_only"] is True and meta["converted_from"] == "dcp"
    assert stored_names(tmp_path / "weights") == set(state)
    convert_checkpoint(folder, tmp_path / "hf")
    assert_same(load_checkpoint(tmp_path / "hf")[0], state)


def test_dcp_reads_in_groups(sources, state):
    source = DCPSource(sources["dcp"], group_bytes=20_000)
    source.bind(ARGS, "test")
    got = dict(source.iter_tensors())
    assert_same(got, state)
    assert 1 < source.reads < len(state)  # neither everything at once nor one call per tensor
    assert not source._cache


# ----------------------------------------------------------------------------- streaming


class TrackedSource(DictSource):
    """Hands out copies and records the most bytes handed out and still alive at once."""

    def __init__(self, state, args):
        super().__init__(state, args)
        self.live = self.peak = 0

    def load(self, name):
        out = self.state_dict[name].clone()
        self.live += out.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(out, self._freed, out.nbytes)
        return out

    def _freed(self, nbytes):
        self.live -= nbytes


@pytest.mark.parametrize("fmt, bound", [("dcp", "tensor"), ("hf", "shard"), ("meta", "shard")])
def test_writers_hold_one_tensor_or_one_shard(state, tmp_path, fmt, bound):
    big = max(v.nbytes for v in state.values())
    total = sum(v.nbytes for v in state.values())
    source = TrackedSource(state, ARGS)
    source.bind(ARGS, "test")
    options = {"hf": {"max_shard_size": 60_000}, "meta": {"shards": 2}}.get(fmt, {})
    write_checkpoint(source, tmp_path / "out", fmt, **options)
    limit = {"tensor": 2 * big, "shard": 60_000 + 2 * big if fmt == "hf" else total // 2 + 2 * big}[bound]
    assert source.peak <= limit < total, (source.peak, limit, total)


# ----------------------------------------------------------------------------- errors


def test_destination_must_be_new_or_empty(sources, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty: refusing to overwrite"):
        convert_checkpoint(sources["meta"], taken, dst_format="hf")
    assert (taken / "notes.txt").read_text() == "mine" and len(list(taken.iterdir())) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_checkpoint(sources["meta"], empty, dst_format="hf")
    assert (empty / "config.json").is_file()
    with pytest.raises(CheckpointError, match="is the source folder|not empty"):
        convert_checkpoint(sources["meta"], sources["meta"], dst_format="meta")


def test_a_config_json_too_large_to_carry_is_refused(sources, tmp_path):
    """A dcp output carries the source's config.json in titanctl.json, which is read back with a limit."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(sources["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "padding": "x" * (1 << 20)}))
    with pytest.raises(CheckpointError, match=r"config.json is larger than 1 MiB: not a model's config"):
        convert_checkpoint(folder, tmp_path / "dcp", dst_format="dcp")
    assert not (tmp_path / "dcp").exists() and not list(tmp_path.glob(".dcp.partial-*"))


def test_failure_mid_write_leaves_nothing(sources, tmp_path, monkeypatch):
    from titanctl.checkpoint.formats.meta import MetaSource

    calls = {"n": 0}
    real = MetaSource.load

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk on fire")
        return real(self, name)

    monkeypatch.setattr(MetaSource, "load", flaky)
    for fmt in ("dcp", "hf"):
        calls["n"] = 0
        with pytest.raises(OSError, match="disk on fire"):
            convert_checkpoint(sources["meta"], tmp_path / fmt, dst_format=fmt)
        assert not (tmp_path / fmt).exists()
    assert not list(tmp_path.iterdir())  # no temporary folder left either


def test_unknown_missing_and_misshaped_tensors(state, sources, tmp_path):
    bad = tmp_path / "extra"
    write_meta(bad, [{**state, "layers.0.attention.bias": torch.zeros(3)}], ARGS.replace(rope_scaling=None))
    with pytest.raises(CheckpointError, match="unknown tensor 'layers.0.attention.bias'"):
        load_checkpoint(bad)
    lacking = {k: v for k, v in state.items() if k != "layers.1.ffn_norm.weight"}
    with pytest.raises(CheckpointError, match="lacks tensor.*layers.1.ffn_norm.weight"):
        load_checkpoint(write_meta(tmp_path / "lacking", [lacking], ARGS.replace(rope_scaling=None)))
    with pytest.raises(CheckpointError, match=r"tensor '(lm_head|model\.embed_tokens)\.weight' has shape \(512, 64\), expected \(512, 4096\).*--flavor 8B"):
        load_checkpoint(sources["hf"], flavor="8B")
    with pytest.raises(CheckpointError, match="unknown tensor 'tok_embeddings.weight'|unknown tensor 'layers"):
        load_checkpoint(sources["meta"], "torchtune")  # Meta names are not torchtune's
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors weights"):
        load_checkpoint(sources["meta"], "hf")
    with pytest.raises(CheckpointError, match="give --flavor or --config"):
        (sources["torchtune"] / "params.json").rename(tmp_path / "params.json")
        try:
            load_checkpoint(sources["torchtune"])
        finally:
            (tmp_path / "params.json").rename(sources["torchtune"] / "params.json")


def test_flavor_override_takes_vocab_from_the_weights(tmp_path):
    args = ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=300)  # debugmodel dims
    model = Transformer(args.replace(max_seq_len=16))
    save_state_dict(model.state_dict(), args, tmp_path / "tt", "torchtune")
    (tmp_path / "tt" / "params.json").unlink()  # torchtune folders often carry no config of ours
    with open_checkpoint(tmp_path / "tt", flavor="debugmodel") as source:
        assert source.args.vocab_size == 300 and source.origin == "--flavor debugmodel"
    from tests.conftest import REPO

    with open_checkpoint(tmp_path / "tt", config=REPO / "recipes" / "llama3_debug.toml") as source:
        assert source.args.vocab_size == 300 and source.args.max_seq_len == 256  # the recipe's seq_len
    with pytest.raises(CheckpointError, match="not both"):
        open_checkpoint(tmp_path / "tt", flavor="8B", config="x.toml")


def test_module_all_is_importable():
    for name in conv.__all__:
        assert hasattr(conv, name), name
    assert conv.FORMATS == FORMATS  # convert.py keeps its own copy to stay free of torch imports
