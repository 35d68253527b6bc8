"""Float8 training on CPU, for real (torch._scaled_mm's CPU kernel), composed with the layouts.

The debug model with 2 layers, seq 64, a global batch of 8, lr 2e-3 after 5 warmup steps (no
decay, so the first steps' learning rates do not depend on the run's length):
- 20 steps in 1 process and on FSDP 2 (float8 all-gathers, precomputed scales): the loss tracks the
  bf16 run within 2% at step 20, and differs from the bf16 run of the same layout at every step
  after the first few (a no-op float8 would reproduce it bit for bit);
- fp32, 10 steps: float8 on TP 2, on PP 2 with full activation checkpointing, and with compile
  equal float8 in 1 process within 1e-4, while float8 itself moves the losses by more than that;
- the FSDP run's checkpoint holds plain fp32 weights under canonical names; `titanctl convert`
  makes a Hugging Face folder whose logits in transformers match ours, and `titanctl infer-tp`
  reads the checkpoint unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.conftest import OFFLINE_ENV, REPO, TITANCTL
from tests.distributed.harness import WORKERS, losses, max_rel_diff, torchrun

RUN = [
    "--model.n_layers", "2", "--training.seq_len", "64", "--training.global_batch_size", "8",
    "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_ratio", "0",
    "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
]
BF16 = [*RUN, "--training.mixed_precision_param", "bfloat16", "--training.steps", "20"]
FP32 = [*RUN, "--training.mixed_precision_param", "float32", "--training.steps", "10"]
FLOAT8 = ["--float8.enable_float8_linear"]
FSDP_FLOAT8 = [*FLOAT8, "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
ONE = (1, ["--training.local_batch_size", "8"])
FSDP2 = (2, ["--training.local_batch_size", "4"])
TP2 = (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"])
# One microbatch of the whole batch: float8's dynamic scales come from the tensors a matmul sees,
# so smaller microbatches (like gradient accumulation) would scale differently from one process.
PP2_FULL_AC = (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_schedule", "GPipe",
                   "--parallelism.pipeline_parallel_microbatch_size", "8", "--activation_checkpoint.mode", "full"])


def train(folder, layout, args) -> tuple[list[float], str]:
    nproc, layout_args = layout
    proc = torchrun(nproc, ["-m", "titanctl", "train"], [*args, *layout_args, "--job.dump_folder", str(folder)])
    return losses(folder), proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8")
    return {
        "bf16": train(root / "bf16", ONE, BF16),
        "float8": train(root / "float8", ONE, [*BF16, *FLOAT8]),
        "fsdp_bf16": train(root / "fsdp_bf16", FSDP2, BF16),
        # A final checkpoint (the interval is never reached before the last step).
        "fsdp_float8": train(root / "fsdp_float8", FSDP2, [*BF16, *FSDP_FLOAT8, "--checkpoint.enable_checkpoint",
                                                           "--checkpoint.interval", "1000"]),
        "root": root,
    }


def check_tracks(float8: list[float], bf16: list[float]) -> None:
    assert len(float8) == len(bf16) == 20
    assert bf16[-1] < bf16[0] - 1.5, bf16  # a learning curve, not a flat line
    assert abs(float8[-1] - bf16[-1]) / bf16[-1] <= 0.02, (float8, bf16)
    assert max_rel_diff(float8, bf16) <= 0.02
    # Same layout, same code but the linears: equal losses would mean float8 did nothing.
    differing = [i for i, (a, b) in enumerate(zip(float8, bf16)) if abs(a - b) / b > 1e-5]
    assert len(differing) >= 15, (float8, bf16)


def test_float8_one_process_tracks_bf16(runs):
    (float8, stdout), (bf16, _) = runs["float8"], runs["bf16"]
    check_tracks(float8, bf16)
    assert "float8: 14 linear layers in float8; kept in high precision: output (float8.filter_fqns)" in stdout
    assert stdout.count("float8 is emulated") == 1


def test_float8_fsdp2_with_float8_all_gathers_tracks_bf16(runs):
    (float8, stdout), (bf16, _) = runs["fsdp_float8"], runs["fsdp_bf16"]
    check_tracks(float8, bf16)
    assert max_rel_diff(float8, runs["bf16"][0]) <= 0.02  # and the one-process bf16 run
    assert stdout.count("float8 is emulated") == 1  # rank 0 only


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8_fp32")
    return {"plain": train(root / "plain", ONE, FP32)[0], "float8": train(root / "float8", ONE, [*FP32, *FLOAT8])[0]}


@pytest.mark.parametrize(
    "layout, note",
    [
        (TP2, "float8 with tensor parallel on gloo: activations are all-gathered in high precision"),
        (PP2_FULL_AC, None),
    ],
    ids=["tp2", "pp2_full_ac"],
)
def test_float8_layouts_equal_float8_in_one_process(tmp_path, fp32_runs, layout, note):
    layout_losses, stdout = train(tmp_path, layout, [*FP32, *FLOAT8])
    assert max_rel_diff(fp32_runs["float8"], fp32_runs["plain"]) > 1e-4  # what float8 itself changes
    assert max_rel_diff(layout_losses, fp32_runs["float8"]) <= 1e-4
    assert "float8: 14 linear layers in float8" in stdout
    assert note is None or note in stdout


def test_float8_compile_equals_float8_eager(tmp_path, fp32_runs):
    compiled, stdout = train(tmp_path, ONE, [*FP32, *FLOAT8, "--compile.enable"])
    assert max_rel_diff(compiled, fp32_runs["float8"]) <= 1e-4
    assert "float8: 14 linear layers in float8" in stdout


def test_float8_tp_styles_run_on_a_one_rank_mesh(tmp_path):
    out = tmp_path / "styles.json"
    torchrun(1, [str(WORKERS / "float8_tp_styles_worker.py")], [str(out)])
    result = json.loads(out.read_text())
    assert result["styles"]["attention"] == result["styles"]["feed_forward"] == "PrepareFloat8ModuleInput"
    assert result["styles"]["attention.wq"] == "Float8ColwiseParallel"
    assert result["styles"]["feed_forward.w2"] == "Float8RowwiseParallel"
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-6)
    assert result["grad_max_abs_diff"] <= 1e-6 * result["grad_max_abs"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*TITANCTL, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_float8_checkpoint_holds_plain_weights_that_convert_and_infer_tp_read(runs, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import LlamaForCausalLM

    from titanctl.checkpoint.convert import load_checkpoint
    from titanctl.models.llama.model import Transformer

    step = runs["root"] / "fsdp_float8" / "checkpoint" / "step-20"
    entries = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    state, args = load_checkpoint(step)
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    assert set(state) == set(expected)  # canonical names, nothing else at the model's level
    for name in expected:
        assert entries[name].properties.dtype == torch.float32, name
        assert type(state[name]) is torch.Tensor and state[name].dtype == torch.float32

    hf = tmp_path / "hf"
    cli("convert", str(step), str(hf), "--to", "hf")
    theirs = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.device("meta"):
        ours = Transformer(args.replace(max_seq_len=64))
    ours.load_state_dict(state, assign=True)
    ours.init_buffers("cpu")
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - theirs(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff

    def greedy_tokens(checkpoint, out) -> list[int]:
        cli("infer-tp", "--checkpoint", str(checkpoint), "--prompt", "The king", "--max-new-tokens", "8",
            "--temperature", "0", "--out", str(out))
        return json.loads(out.read_text())["tokens"]

    from_dcp = greedy_tokens(step, tmp_path / "dcp.json")
    assert len(from_dcp) >= 8 and from_dcp == greedy_tokens(hf, tmp_path / "hf.json")
