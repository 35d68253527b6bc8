"""`titanctl infer-tp` reads every format `titanctl convert` reads, and its greedy tokens equal
transformers' `generate(do_sample=False)` on the same prompt ids.

Two tiny models built with transformers in-process (no hub), unit-scale weights so that logits
are not near-tied: a Qwen3 saved with `save_pretrained` beside a Qwen-style tokenizer.json +
tokenizer_config.json (fewer ids than the model's embedding rows, no BOS, as Qwen3's), and a Llama
of the debug model's shape (the bundled tokenizer's vocabulary), converted by titanctl to Meta,
torchtune, torchtitan and DCP.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO
from tests.unit.data.test_hf_tokenizer import train_qwen_style
from tests.unit.hf_reference import unit_scale_
from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.checkpoint.hf.names import hf_config
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import CheckpointError, ConfigError, DataError
from titanctl.inference.generate import check_vocab, run
from titanctl.inference.sampling import Sampling, sample, seed_key
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.qwen3.args import qwen3_args

PROMPT = "The quick brown fox"
NEW = 12
# 448 embedding rows for the tokenizer's 423 ids (train_qwen_style): Qwen3's padding, in small.
QWEN = qwen3_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=160, tied=False, head_dim=32).replace(
    vocab_size=448, max_seq_len=128
)
LLAMA = LLAMA3_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=4352, max_seq_len=128)
LLAMA_FORMATS = ("meta", "torchtune", "torchtitan", "dcp")


@pytest.fixture(scope="module", autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run() sizes torch's pool for its one process


@pytest.fixture(scope="module")
def transformers():
    import transformers  # offline: tests/conftest.py sets HF_HUB_OFFLINE etc. and a temporary HF_HOME

    return transformers


def reference(model, ids: list[int], stop_tokens: set[int], vocab: int | None = None) -> list[int]:
    """transformers' greedy tokens, ids from ``vocab`` on suppressed, cut after the first stop token
    (where infer-tp stops)."""
    from transformers import GenerationConfig

    rows = model.config.vocab_size
    suppress = list(range(vocab, rows)) if vocab is not None and vocab < rows else None
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                              suppress_tokens=suppress)
    with torch.no_grad():
        tokens = model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in stop_tokens), None)
    return tokens if stop is None else tokens[: stop + 1]


@pytest.fixture(scope="module")
def qwen(transformers, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("infer_qwen")
    folder = root / "hf"
    train_qwen_style(folder)  # tokenizer.json + tokenizer_config.json
    tokenizer = Tokenizer(folder / "tokenizer.json")
    assert tokenizer.vocab_size == 423 < QWEN.vocab_size and tokenizer.bos_id is None
    config = transformers.Qwen3Config(
        vocab_size=QWEN.vocab_size, hidden_size=QWEN.dim, intermediate_size=QWEN.ffn_hidden_dim,
        num_hidden_layers=QWEN.n_layers, num_attention_heads=QWEN.n_heads, num_key_value_heads=QWEN.kv_heads,
        head_dim=QWEN.head_dim, rms_norm_eps=QWEN.norm_eps, max_position_embeddings=QWEN.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN.rope_theta}, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    unit_scale_(model)
    with torch.no_grad():  # the padding rows score high: a greedy choice among all rows picks them
        model.lm_head.weight[tokenizer.vocab_size:] *= 3
    model.save_pretrained(folder)
    ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    return SimpleNamespace(
        root=root, folder=folder, model=model, tokenizer=tokenizer, ids=ids,
        want=reference(model, ids, tokenizer.stop_tokens, tokenizer.vocab_size),
        unmasked=reference(model, ids, tokenizer.stop_tokens),
    )


@pytest.fixture(scope="module")
def llama(transformers, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("infer_llama")
    config = transformers.LlamaConfig(**hf_config(LLAMA))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    unit_scale_(model)
    model.save_pretrained(root / "hf")  # no tokenizer files: the bundled tokenizer fits its vocabulary
    for fmt in LLAMA_FORMATS:
        convert_checkpoint(root / "hf", root / fmt, dst_format=fmt)
    tokenizer = Tokenizer()
    ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    return SimpleNamespace(root=root, model=model, ids=ids, want=reference(model, ids, tokenizer.stop_tokens))


def greedy(folder: Path, **kwargs):
    return run(folder, PROMPT, max_new_tokens=NEW, temperature=0, **kwargs)


# ----------------------------------------------------------------------------- Qwen3, Hugging Face folder


def test_qwen3_hf_folder_with_its_tokenizer_equals_transformers(qwen):
    assert any(t >= qwen.tokenizer.vocab_size for t in qwen.unmasked)  # the mask below has teeth
    report = greedy(qwen.folder)
    assert report.generation.prompt_tokens == qwen.ids
    assert report.generation.tokens == qwen.want
    assert all(t < qwen.tokenizer.vocab_size for t in report.generation.tokens)
    assert report.source.kind == "hf" and report.source.args.family == "qwen3"
    assert report.source.args.vocab_size == QWEN.vocab_size and report.sampling.vocab == qwen.tokenizer.vocab_size
    stops = qwen.tokenizer.stop_tokens
    assert report.text == qwen.tokenizer.decode([t for t in qwen.want if t not in stops])
    # Sampling never draws an id the tokenizer cannot decode either.
    hot = run(qwen.folder, PROMPT, max_new_tokens=NEW, temperature=5.0, top_k=0, seed=3)
    assert all(t < qwen.tokenizer.vocab_size for t in hot.generation.tokens)


@pytest.mark.slow
def test_qwen3_cli_equals_transformers(qwen, tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    proc = titanctl_run(["infer-tp", "--checkpoint", str(qwen.folder), "--prompt", PROMPT, "--temperature", "0",
         "--max-new-tokens", str(NEW), "--out", str(out)], env=env, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["tokens"] == qwen.want and data["prompt_tokens"] == qwen.ids
    assert data["checkpoint_format"] == "Hugging Face safetensors"


@pytest.mark.slow
def test_qwen3_tensor_parallel_2_equals_transformers(qwen, tmp_path):
    """Two ranks: heads and the (448-row) output layer split, ids past the tokenizer's masked after the gather."""
    from tests.distributed.harness import CLI, torchrun

    out = tmp_path / "out.json"
    torchrun(2, [*CLI, "infer-tp"], [
        "--checkpoint", str(qwen.folder), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW),
        "--out", str(out)], timeout=300)
    data = json.loads(out.read_text())
    assert data["tokens"] == qwen.want and data["tensor_parallel_degree"] == 2


def test_qwen3_dcp_export_in_a_run_folder(qwen):
    """hf -> dcp, as step-3 of a checkpoint folder; the tokenizer given with --model.tokenizer_path."""
    run_folder = qwen.root / "checkpoint"
    convert_checkpoint(qwen.folder, run_folder / "step-3", dst_format="dcp")
    (run_folder / "step-9").mkdir()  # no titanctl.json or .metadata: not a complete checkpoint
    report = greedy(run_folder, overrides=["--model.tokenizer_path", str(qwen.folder / "tokenizer.json")])
    assert report.source.folder == run_folder / "step-3" and report.source.kind == "dcp"
    assert report.source.args.family == "qwen3"
    assert report.generation.tokens == qwen.want


def test_qwen3_torchtitan_export(qwen):
    convert_checkpoint(qwen.folder, qwen.root / "torchtitan", dst_format="torchtitan")
    report = greedy(qwen.root / "torchtitan", overrides=["--model.tokenizer_path", str(qwen.folder / "tokenizer.json")])
    assert report.source.kind == "torchtitan" and report.source.args.family == "qwen3"
    assert report.generation.tokens == qwen.want


def test_empty_prompt_without_bos_is_one_line(qwen, capsys):
    with pytest.raises(ConfigError, match="--prompt is empty and tokenizer .* has no BOS token"):
        run(qwen.folder, "", max_new_tokens=2, temperature=0)
    from titanctl.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["infer-tp", "--checkpoint", str(qwen.folder), "--prompt", "", "--temperature", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "has no BOS token" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- Llama, every format


@pytest.mark.parametrize("fmt", ["hf", *LLAMA_FORMATS])
def test_llama_every_format_equals_transformers(llama, fmt):
    report = greedy(llama.root / fmt)
    assert report.source.kind == fmt and report.source.args.family == "llama3"
    assert report.generation.prompt_tokens == llama.ids
    assert report.generation.tokens == llama.want
    assert report.sampling.vocab == 0  # the tokenizer has every id the model has


def test_llama_torchtitan_without_params_json(llama, tmp_path):
    """torchtitan's own folders carry no config: the model is the flavor the shapes are, or a recipe's."""
    folder = tmp_path / "tt"
    shutil.copytree(llama.root / "torchtitan", folder)
    (folder / "params.json").unlink()
    inferred = greedy(folder)
    assert inferred.source.origin.startswith("tensor shapes") and "debugmodel" in inferred.source.origin
    assert inferred.generation.tokens == llama.want
    recipe = greedy(folder, config=REPO / "recipes" / "llama3_debug.toml", overrides=["--model.n_layers", "2"])
    assert recipe.source.origin.startswith("--config") and recipe.generation.tokens == llama.want


def test_model_that_no_file_or_shape_names_needs_a_recipe(qwen, tmp_path):
    """A DCP folder without titanctl.json or params.json, of a model of no published flavor."""
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.convert import load_checkpoint

    state, _ = load_checkpoint(qwen.folder)
    dcp.save(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"has no params\.json or config\.json and its model cannot be told from its tensors "
                                              r"\(.*no published flavor.*\): pass --config RECIPE"):
        greedy(tmp_path / "tt")


# ----------------------------------------------------------------------------- vocabulary checks


def test_check_vocab_accepts_fewer_tokenizer_ids():
    args = QWEN.replace(vocab_size=151936)
    check_vocab(args, 151669, Path("tokenizer.json"))  # Qwen3's published padding
    check_vocab(args, 151936, Path("tokenizer.json"))
    with pytest.raises(DataError, match="vocabulary of 151936 tokens but tokenizer tokenizer.json has 151937"):
        check_vocab(args, 151937, Path("tokenizer.json"))
    with pytest.raises(DataError, match="has 151669"):  # a guessed (bundled) tokenizer must fit exactly
        check_vocab(args, 151669, Path("tokenizer.model"), exact=True)


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (2.0, 5)])
def test_sampling_leaves_out_ids_past_the_vocabulary(temperature, top_k):
    """As if the logits past ``vocab`` were -inf: the same draws, none of them past it."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    logits[0, 50:] += 10  # the rows past the tokenizer's ids would win
    masked = logits.clone()
    masked[0, 50:] = float("-inf")
    key = torch.tensor(seed_key(7))
    for pos in range(20):
        position = torch.tensor([pos])
        got = sample(logits, Sampling(temperature, top_k, vocab=50), key, position)
        assert torch.equal(got, sample(masked, Sampling(temperature, top_k), key, position))
        assert int(got) < 50


def test_a_checkpoint_that_declares_its_model_refuses_model_overrides(tmp_path):
    from titanctl.checkpoint.weights import CheckpointSource
    from titanctl.errors import ConfigError
    from titanctl.inference.generate import check_model_overrides
    from titanctl.models.llama.args import LLAMA3_FLAVORS
    declared = CheckpointSource("hf", tmp_path, LLAMA3_FLAVORS["debugmodel"], origin="config.json")
    with pytest.raises(ConfigError, match=r"^--model.n_layers is not read by infer-tp for .*config.json"):
        check_model_overrides(["--model.n_layers", "2"], declared)
    with pytest.raises(ConfigError, match="--training.seq_len is not read"):
        check_model_overrides(["--training.seq_len=64"], declared)
    check_model_overrides(["--model.tokenizer_path", "x.model"], declared)  # the checkpoint does not decide it
    check_model_overrides(["--model.n_layers", "2"], CheckpointSource("torchtitan", tmp_path, None))


def write_qwen3_moe_folder(transformers, tokenizer_folder: Path, folder: Path):
    """A Qwen3-MoE folder as transformers 5.23 saves it (one tensor per expert; unit-scale random
    weights), with the tokenizer files of ``tokenizer_folder``; returns the transformers model."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=QWEN.vocab_size, hidden_size=QWEN.dim, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=QWEN.n_layers, num_attention_heads=QWEN.n_heads, num_key_value_heads=QWEN.kv_heads,
        head_dim=QWEN.head_dim, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        rms_norm_eps=QWEN.norm_eps, max_position_embeddings=QWEN.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN.rope_theta}, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # unit scale, the 3-D expert stacks by their input width
        for name, p in model.named_parameters():
            if "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


def test_qwen3_moe_hf_folder_equals_transformers(qwen, transformers, tmp_path):
    """A Qwen3-MoE folder as transformers saves it, with Qwen's tokenizer: infer-tp's greedy tokens
    equal generate()'s (tests/distributed/test_infer_tp.py: also under TP 2)."""
    model = write_qwen3_moe_folder(transformers, qwen.folder, tmp_path / "moe")
    report = greedy(tmp_path / "moe")
    assert report.source.args.family == "qwen3_moe" and report.source.args.moe.num_experts == 4
    assert report.generation.tokens == reference(model, qwen.ids, qwen.tokenizer.stop_tokens, qwen.tokenizer.vocab_size)
