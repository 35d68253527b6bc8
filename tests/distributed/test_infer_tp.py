"""`titanctl infer-tp`: tensor-parallel generation equals one-process generation token for token
(greedy), sampling is reproducible per seed across runs and TP degrees, DCP and Hugging Face
checkpoints both load, and bad input is one red line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO
from tests.distributed.harness import CLI, WORKERS, torchrun
from tests.distributed.workers.gen_checkpoint import make_checkpoints
from tests.distributed.workers.gen_worker import SAMPLING

PROMPT = "The quick brown"
MAX_NEW = 20


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, single_thread):
    return make_checkpoints(tmp_path_factory.mktemp("gen_ckpt"))


def one_process(folder: Path, **sampling) -> list[int]:
    """Generation in this process, without a process group: the reference."""
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.inference.generate import find_checkpoint, generate, load_model

    source = find_checkpoint(folder)
    ids = Tokenizer().encode(PROMPT, bos=True, eos=False)
    model = load_model(source, source.args.replace(max_seq_len=len(ids) + MAX_NEW), torch.device("cpu"))
    return generate(model, ids, MAX_NEW, **sampling).tokens


@pytest.fixture(scope="module")
def reference(checkpoints):
    dcp_folder, _ = checkpoints
    return {
        "greedy": one_process(dcp_folder, temperature=0),
        "sample_7": one_process(dcp_folder, seed=7, **SAMPLING),
    }


def cli(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return titanctl_run([*args], env=env, timeout=300, cwd=REPO)


def test_greedy_tp2_equals_one_process(checkpoints, reference, tmp_path):
    dcp_folder, _ = checkpoints
    out = tmp_path / "out.json"
    proc = torchrun(2, [*CLI, "infer-tp"], [
        "--checkpoint", str(dcp_folder), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
        "--temperature", "0", "--out", str(out)], timeout=300)
    data = json.loads(out.read_text())
    assert data["tokens"] == reference["greedy"]
    assert {"tokens", "text", "tokens_per_second"} <= data.keys()
    assert data["tensor_parallel_degree"] == 2 and data["tokens_per_second"] > 0
    assert data["text"] and data["text"] in proc.stdout
    assert "tokens/s" in proc.stdout
    # the tiny model learned its one sentence: greedy decoding recites it
    assert data["text"].startswith(" fox jumps over the lazy dog")


def gpt_oss_folder(folder: Path) -> list[int]:
    """A transformers-saved gpt-oss folder (window 4, sinks, biases, YaRN) over the bundled tokenizer's
    ids; returns generate()'s greedy tokens for PROMPT: prompt and generation span more than two windows."""
    from transformers import GenerationConfig

    from tests.unit.models.families import gpt_oss_model
    from titanctl.data.tokenizer import Tokenizer

    tokenizer = Tokenizer()
    model = gpt_oss_model(vocab_size=tokenizer.vocab_size, sliding_window=4)
    model.save_pretrained(folder)
    ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    assert len(ids) + MAX_NEW > 2 * 4
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()


def test_tp2_sampling_and_hf_checkpoint(checkpoints, reference, tmp_path):
    dcp_folder, hf_folder = checkpoints
    gpt_oss_want = gpt_oss_folder(tmp_path / "gpt_oss")
    torchrun(2, [str(WORKERS / "gen_worker.py")],
             [str(dcp_folder), str(hf_folder), PROMPT, str(MAX_NEW), str(tmp_path), str(tmp_path / "gpt_oss")],
             timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank decoded the same tokens
    got = ranks[0]
    assert got["sample_7"] == got["sample_7_again"] == reference["sample_7"]  # across runs and TP degrees
    assert got["sample_8"] != got["sample_7"]
    assert got["hf_greedy"] == reference["greedy"]  # the same weights through safetensors, exchanged over gloo
    # collectives inside the compiled decode step: the shared memory op, or gloo's traced ones
    assert got["greedy_compiled"] == got["hf_greedy_compiled"] == reference["greedy"]
    assert got["dcp_over_shared_memory"] and not got["dcp_decode_uses_process_group"]
    assert not got["hf_over_shared_memory"] and got["hf_decode_uses_process_group"]
    assert got["gpt_oss_greedy"] == gpt_oss_want  # sliding windows, sinks and biases under TP 2


@pytest.mark.parametrize("nproc", [2, 3])
def test_shared_memory_gather_equals_gloo(nproc, tmp_path):
    torchrun(nproc, [str(WORKERS / "shm_exchange_worker.py")], [str(tmp_path)], timeout=300)
    for rank in range(nproc):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"rounds": 300, "large_via_gloo": True, "leftover_segments": [], "fallback": "None"}


def test_one_process_cli_hf_sampling_is_reproducible(checkpoints, reference, tmp_path):
    _, hf_folder = checkpoints
    out = tmp_path / "hf.json"
    proc = cli(["infer-tp", "--checkpoint", str(hf_folder), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
                "--temperature", str(SAMPLING["temperature"]), "--top-k", str(SAMPLING["top_k"]), "--seed", "7",
                "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["tokens"] == reference["sample_7"]
    assert data["seed"] == 7 and data["tensor_parallel_degree"] == 1
    assert data["checkpoint_format"] == "Hugging Face safetensors"


@pytest.mark.parametrize(
    "args, env_extra, message",
    [
        # rank 0 of a 3-process job: 4 heads / 2 KV heads cannot be split 3 ways (checked before any collective)
        ([], {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
         "n_heads = 4 is not divisible by the 3 processes"),
        (["--checkpoint", str(REPO / "recipes")], {}, "is not a checkpoint"),
    ],
    ids=["heads_not_divisible", "not_a_checkpoint"],
)
def test_bad_input_is_one_red_line(checkpoints, args, env_extra, message, monkeypatch, capsys):
    """In this process (fast): the errors come before any process group exists."""
    from titanctl.cli.app import main

    dcp_folder, _ = checkpoints
    for key, value in env_extra.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        main(["infer-tp", "--checkpoint", str(dcp_folder), "--prompt", PROMPT, *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_qwen3_moe_tp2_equals_transformers(tmp_path):
    """A transformers-written Qwen3-MoE folder under TP 2: attention split over the ranks, router and
    experts whole on each; the greedy tokens equal generate()'s."""
    import transformers

    from tests.unit.data.test_hf_tokenizer import train_qwen_style
    from tests.unit.inference.test_infer_formats import NEW, reference, write_qwen3_moe_folder
    from tests.unit.inference.test_infer_formats import PROMPT as QWEN_PROMPT
    from titanctl.data.tokenizer import Tokenizer

    train_qwen_style(tmp_path / "tokenizer")
    model = write_qwen3_moe_folder(transformers, tmp_path / "tokenizer", tmp_path / "moe")
    tokenizer = Tokenizer(tmp_path / "moe" / "tokenizer.json")
    ids = tokenizer.encode(QWEN_PROMPT, bos=True, eos=False)
    want = reference(model, ids, tokenizer.stop_tokens, tokenizer.vocab_size)
    assert greedy_tokens_under_tp2(tmp_path / "moe", QWEN_PROMPT, NEW, tmp_path) == want


def greedy_tokens_under_tp2(folder: Path, prompt: str, new_tokens: int, tmp_path: Path) -> list[int]:
    """The tokens `titanctl infer-tp` generates greedily from ``folder`` on 2 ranks."""
    out = tmp_path / "out.json"
    torchrun(2, [*CLI, "infer-tp"], [
        "--checkpoint", str(folder), "--prompt", prompt, "--max-new-tokens", str(new_tokens),
        "--temperature", "0", "--out", str(out)], timeout=300)
    data = json.loads(out.read_text())
    assert data["tensor_parallel_degree"] == 2
    return data["tokens"]


def test_deepseek_v3_tp2_equals_transformers(tmp_path):
    """A transformers-written DeepSeek-V3 folder (q LoRA, YaRN, a dense first layer, grouped routing)
    under TP 2: latent attention split by heads, its latent projections and cache whole on each rank;
    the greedy tokens equal generate()'s."""
    import shutil

    import transformers

    from tests.unit.data.test_hf_tokenizer import train_qwen_style
    from tests.unit.hf_reference import unit_scale_
    from tests.unit.inference.test_infer_formats import NEW, reference
    from tests.unit.inference.test_infer_formats import PROMPT as QWEN_PROMPT
    from tests.unit.models.families import V3_ROPE, deepseek_v3_config
    from titanctl.data.tokenizer import Tokenizer

    train_qwen_style(tmp_path / "tokenizer")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        deepseek_v3_config(q_lora_rank=48, rope_parameters=V3_ROPE, rope_interleave=True)).eval()
    unit_scale_(model, torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "deepseek")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tokenizer" / name, tmp_path / "deepseek" / name)
    tokenizer = Tokenizer(tmp_path / "deepseek" / "tokenizer.json")
    ids = tokenizer.encode(QWEN_PROMPT, bos=True, eos=False)
    want = reference(model, ids, tokenizer.stop_tokens, tokenizer.vocab_size)
    assert len(want) > 1 and greedy_tokens_under_tp2(tmp_path / "deepseek", QWEN_PROMPT, NEW, tmp_path) == want


def test_qwen3_5_tp2_equals_transformers(tmp_path):
    """A transformers-written Qwen3.5 folder under TP 2: each rank holds one key-head group of every Gated
    DeltaNet layer (its rows of the Hub's [q | k | v] projection and conv, reordered on load) and a decode
    cache of that group's conv window and state, and half the full-attention heads; the greedy tokens
    equal generate()'s."""
    import shutil

    import transformers

    from tests.unit.data.test_hf_tokenizer import train_qwen_style
    from tests.unit.hf_reference import unit_scale_
    from tests.unit.inference.test_infer_formats import NEW, reference
    from tests.unit.inference.test_infer_formats import PROMPT as QWEN_PROMPT
    from tests.unit.models.families import qwen3_5_config
    from titanctl.data.tokenizer import Tokenizer

    train_qwen_style(tmp_path / "tokenizer")
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(qwen3_5_config(vocab_size=448, max_position_embeddings=128)).eval()
    unit_scale_(model, torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "qwen3_5")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tokenizer" / name, tmp_path / "qwen3_5" / name)
    tokenizer = Tokenizer(tmp_path / "qwen3_5" / "tokenizer.json")
    ids = tokenizer.encode(QWEN_PROMPT, bos=True, eos=False)
    want = reference(model, ids, tokenizer.stop_tokens, tokenizer.vocab_size)
    assert len(want) > 1 and greedy_tokens_under_tp2(tmp_path / "qwen3_5", QWEN_PROMPT, NEW, tmp_path) == want


def test_deepseek_v4_tp2_equals_transformers(tmp_path):
    """A transformers-written DeepSeek-V4 folder (CSA with its indexer, HCA, sliding, hash-routed MoE) under TP 2:
    the query heads, sinks and output groups split over the ranks, the shared KV head, compressors, indexer,
    their caches and the MoE whole on each; the greedy tokens equal generate()'s."""
    from tests.unit.inference.test_deepseek_v4_generate import NEW as V4_NEW
    from tests.unit.inference.test_deepseek_v4_generate import PROMPT as V4_PROMPT
    from tests.unit.inference.test_deepseek_v4_generate import write_folder

    v4 = write_folder(tmp_path / "deepseek_v4")
    assert greedy_tokens_under_tp2(v4.folder, V4_PROMPT, V4_NEW, tmp_path) == v4.want
