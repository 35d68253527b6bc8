"""Throughput, FLOPs and memory columns of a log row."""

from __future__ import annotations

import pytest
import torch

from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.train import metrics
from titanctl.train.flops import flops_per_token, throughput
from titanctl.train.metrics import MemoryMonitor


@pytest.mark.parametrize("tp, pp, cp, dp", [(1, 1, 1, 1), (2, 1, 1, 4), (1, 2, 1, 2), (1, 1, 2, 2), (8, 1, 1, 64)])
def test_tps_is_per_device_under_every_layout(tp, pp, cp, dp):
    world = tp * pp * cp * dp
    global_tokens = 16 * 2048  # per optimizer step
    rate = throughput(global_tokens, steps=4, seconds=2.0, world_size=world, flops_per_token=1e9, peak_tflops=100.0)
    assert rate.step_time == 0.5
    per_dp_rank = global_tokens / dp / 0.5  # what each data-parallel rank processes per second
    assert rate.tps == pytest.approx(per_dp_rank / (tp * pp * cp))
    assert rate.tflops == pytest.approx(rate.tps * 1e9 / 1e12)
    assert rate.mfu == pytest.approx(100 * rate.tflops / 100.0)
    assert throughput(global_tokens, 4, 2.0, world, 1e9, None).mfu is None


def test_flops_per_token_counts_the_whole_models_non_embedding_parameters():
    args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=4352, n_layers=2, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 64
    assert flops_per_token(args, 64) == 6 * n + attention


def test_flops_per_token_of_8b_is_the_published_figure():
    # Llama 3.1 8B: 7.5e9 non-embedding parameters (output layer included) -> ~4.5e10 + attention.
    args = LLAMA3_FLAVORS["8B"].replace(vocab_size=128256)
    fpt = flops_per_token(args, 8192)
    assert 6 * 7.4e9 < fpt - 12 * 32 * 32 * 128 * 8192 < 6 * 7.6e9


def test_cpu_memory_is_the_process_peak_rss():
    row = MemoryMonitor(torch.device("cpu")).read()
    assert set(row) == {"memory_gib"} and row["memory_gib"] > 0


class FakeCuda:
    """torch.cuda's memory API as the CUDA caching allocator would answer it."""

    def __init__(self):
        self.stats = {
            "reserved_bytes.all.peak": 0, "active_bytes.all.peak": 0, "num_alloc_retries": 3, "num_ooms": 1,
        }
        self.resets = 0

    def memory_stats(self, device):
        assert device == torch.device("cuda", 0)
        return dict(self.stats)

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.stats["reserved_bytes.all.peak"] = self.stats["active_bytes.all.peak"] = 0

    def get_device_properties(self, device):
        return type("Props", (), {"total_memory": 80 * 2**30})()


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("memory_stats", "reset_peak_memory_stats", "get_device_properties"):
        monkeypatch.setattr(metrics.torch.cuda, name, getattr(fake, name))
    return fake


def test_cuda_memory_columns_per_log_window(fake_cuda):
    monitor = MemoryMonitor(torch.device("cuda", 0))
    assert fake_cuda.resets == 1  # the first window starts at construction

    fake_cuda.stats.update({"reserved_bytes.all.peak": 40 * 2**30, "active_bytes.all.peak": 30 * 2**30,
                            "num_alloc_retries": 5, "num_ooms": 1})
    assert monitor.read() == {
        "memory_gib": 40.0,  # max reserved, not allocated
        "memory_active_gib": 30.0,
        "memory_reserved_pct": 50.0,
        "num_alloc_retries": 2,  # counted since construction: 5 - 3
        "num_ooms": 0,
    }
    assert fake_cuda.resets == 2  # peaks restart for the next window

    fake_cuda.stats.update({"reserved_bytes.all.peak": 20 * 2**30, "active_bytes.all.peak": 10 * 2**30,
                            "num_alloc_retries": 5, "num_ooms": 2})
    row = monitor.read()
    assert row["memory_gib"] == 20.0 and row["memory_reserved_pct"] == 25.0
    assert row["num_alloc_retries"] == 0 and row["num_ooms"] == 1  # this window's only


@pytest.mark.slow
def test_training_logs_the_documented_columns(tmp_path):
    """A short in-process run: the row's throughput columns agree with its own step time."""
    import json

    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer

    cfg = load_config(None, ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--training.steps", "3", "--metrics.log_freq", "1", "--metrics.peak_tflops", "2.0",
                             "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    columns = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "step_time", "memory_gib", "tokens_seen",
               "tokens_by_source"}
    # The process's first step (compile, warm-up) is alone in its window: its time, no rates.
    first, rows = rows[0], rows[1:]
    assert set(first) == columns and first["tps"] is first["tflops"] is first["mfu"] is None
    assert first["step_time"] > 0
    for row in rows:
        assert columns == set(row)
        assert row["tokens_by_source"] == {"bundled": row["step"] * 2 * 32}
        # tps is logged to 0.1: on a busy machine (tps ~40) that rounding alone exceeds 1e-3.
        assert row["tps"] == pytest.approx(2 * 32 / row["step_time"], rel=1e-3, abs=0.05)
        assert row["tflops"] == pytest.approx(row["tps"] * trainer.flops_per_token / 1e12, rel=1e-2)
        # mfu is logged to 0.001 (%): on a busy machine (mfu ~0.02) that rounding alone exceeds 1e-2.
        assert row["mfu"] == pytest.approx(100 * row["tps"] * trainer.flops_per_token / 2e12, rel=1e-2, abs=5e-4)
