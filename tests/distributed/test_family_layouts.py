"""Every family under every parallel layout reproduces the single-process run: same initial weights bit
for bit, the first step's gradient of every parameter, per-step losses within 1e-5 relative (fp32) and
each step's tokens per expert, on real torchrun + gloo: Qwen3 (per-head QK norm, tied embeddings, queries
wider than dim), Qwen3-MoE, DeepSeek-V3 and gpt-oss here, over one list of (reference, layout) cases;
Llama's dense layouts (every AC mode, compile, fused norms, pipeline schedules) in test_layouts.py.

Losses alone would miss a wrong gradient: clipping (always active here) and AdamW, both blind to the
scale of a gradient, turned an under-reduced q_norm/k_norm gradient under TP (each rank summing its
own heads only) into a loss drift of 6e-7 over 5 steps. So each run also writes its first step's
gradients (the tied table's is the sum of the embedding's and the output layer's).

DeepSeek-V3's debug model (latent attention, a dense first layer, grouped routing) takes the MoE
checks under TP 2, EP 2 x TP 2, EP 2 x FSDP 2, EP 2 x CP 2, EP 2 x PP 2 and HSDP, and with a
multi-token-prediction depth under TP 2 and EP 2 x FSDP 2.

gpt-oss's debug model (attention sinks and biases, sliding-window layers of 32 positions over 64-token
windows alternating with full ones, YaRN; clamped-SwiGLU experts with biases, a biased router): every bias
starts non-zero (as torchtitan draws them), so a bias added once per TP rank (torchtitan #4245) shows in
the first loss. Under context parallelism every layer attends under its own mask (sliding or full), and a
block-causal document mask combines with the sliding window, whose windows here are longer than some
documents and shorter than others.

The layout cases of each process count share one torchrun world (tests/distributed/worlds.py), which
also writes those gradients. This file is the torchrun script of pp_worker.py (every schedule, one
launch) with Qwen3's args (see the bottom).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.distributed.harness import (
    TINY_RUN,
    assert_same_init,
    expert_loads,
    gathered,
    init_digests,
    lone_rank,
    losses,
    max_rel_diff,
    rows,
    torchrun,
    worst_tensor_diff,
)
from tests.distributed.worlds import ROOT, register
from titanctl.parallel.layouts.pipeline_stages import SCHEDULES

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
QWEN3_UNTIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"]
# Qwen3-MoE (8 experts, top-2): every parameter's gradient, routers included, is compared too, with
# both balancing methods on: the auxiliary loss's gradient is in the first step's, and the bias update
# changes the routing of later steps (each step's expert load is compared as well).
QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
             "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
# DeepSeek-V3's debug model: latent attention, a dense first layer, then shared and routed experts
# chosen within the best expert groups (sigmoid scores), with the same balancing.
DEEPSEEK_V3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
               "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
# With a multi-token-prediction depth: its block, norms and projection, and the shared embedding and output
# layer's gradient from both losses.
DEEPSEEK_V3_MTP = [*DEEPSEEK_V3, "--model.mtp_layers", "1", "--model.mtp_loss_weight", "0.3"]
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel",
           "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
WORDS = "the of and to in a is that for it as with was on be by at this had not are but from or have".split()


def write_documents(root: Path) -> None:
    # 4 to 60 words each: some documents shorter than the 32-position window, some longer.
    docs = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + (i * 13) % 57)) for i in range(400)]
    (root / "gpt_oss_documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


DOCUMENTS = ["--training.dataset_path", f"{ROOT}/gpt_oss_documents.jsonl", "--model.attn_mask_type", "block_causal"]
FLAVORS = {"tied": QWEN3, "untied": QWEN3_UNTIED, "moe": QWEN3_MOE, "deepseek": DEEPSEEK_V3,
           "deepseek_mtp": DEEPSEEK_V3_MTP, "gpt_oss": GPT_OSS, "gpt_oss_documents": [*GPT_OSS, *DOCUMENTS]}
# MoE layers a reference's expert loads cover (DeepSeek-V3's first layer is dense; the MTP block is MoE).
MOE_LAYERS = {"moe": 4, "deepseek": 3, "deepseek_mtp": 4}
# Of each tensor's largest first-step gradient: the layouts give up to 3e-6 (summation order); gpt-oss's 1e-5.
GRAD_TOL = {"gpt_oss": 1e-5, "gpt_oss_documents": 1e-5}
DEFAULT_GRAD_TOL = 1e-4
PP_STEPS = 4  # pp_worker's default is 3: one more, so a wrong gradient shows in 3 losses


REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *flavor, "--training.local_batch_size", "8"],
                             grads=True, always=True, prepare=write_documents if name.startswith("gpt_oss") else None)
              for name, flavor in FLAVORS.items()}


@pytest.fixture(scope="module")
def references(worlds) -> dict[str, tuple[list[float], dict, dict, list]]:
    """One process, 8 sequences a step: Qwen3's tied debugmodel, the untied one (pipeline layouts), the MoE
    families'."""
    out = {}
    for name, key in REFERENCES.items():
        folder = worlds.folder(key)
        out[name] = losses(folder), init_digests(folder, 1), gathered(folder, 1, "grads"), expert_loads(folder)
        if name.startswith("gpt_oss"):  # the biases matter from the first step
            assert gathered(folder, 1, "init")["layers.0.attention.wo.bias"].abs().min() > 0
    return out


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]

# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", "tied", 2, 4, []),
    ("hsdp2x2", "tied", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("ddp2", "tied", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                            "--parallelism.data_parallel_shard_degree", "1"]),
    ("tp2_sp_loss_parallel", "tied", 2, 8, TP2),
    ("tp2_compile", "tied", 2, 8, [*TP2, "--compile.enable"]),
    # Also TP without loss parallel: the output layer (the tied table) gathers its logits.
    ("fsdp2_tp2_no_loss_parallel", "tied", 4, 4, [*TP2, "--parallelism.disable_loss_parallel"]),
    ("cp2", "tied", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
    ("fsdp2_tp2_pp2", "untied", 8, 4, [*PP2, *TP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("moe_fsdp2", "moe", 2, 4, []),
    ("moe_hsdp2x2", "moe", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("moe_ddp2", "moe", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                               "--parallelism.data_parallel_shard_degree", "1"]),
    ("moe_cp2_compile", "moe", 2, 8, ["--parallelism.context_parallel_degree", "2", "--compile.enable"]),
    ("moe_fsdp2_pp2", "moe", 4, 4, PP2),
    ("moe_tp2", "moe", 2, 8, TP2),
    ("moe_ep2", "moe", 2, 4, EP2),
    ("moe_ep2_tp2", "moe", 4, 4, [*EP2, *TP2]),
    ("moe_ep2_fsdp2", "moe", 4, 2, EP2),
    ("moe_ep2_hsdp2x2", "moe", 4, 2, [*EP2, "--parallelism.data_parallel_replicate_degree", "2"]),
    ("moe_ep2_pp2", "moe", 4, 4, [*EP2, *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    # Zero bubble splits each backward into the inputs' and the weights' parts: the all-to-all runs in the first.
    ("moe_ep2_pp2_zbv", "moe", 4, 4, [*EP2, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("moe_ep2_cp2_ac", "moe", 2, 8, [*EP2, "--parallelism.context_parallel_degree", "2",
                                     "--activation_checkpoint.mode", "full"]),
    # Latent attention split by heads (its latent projections whole on every rank), the experts replicated.
    ("deepseek_tp2", "deepseek", 2, 8, TP2),
    ("deepseek_ep2_tp2", "deepseek", 4, 4, [*EP2, *TP2]),
    ("deepseek_ep2_fsdp2", "deepseek", 4, 2, EP2),
    # Ring attention over the CP ranks (the values padded to the query/key width for flash attention).
    ("deepseek_ep2_cp2", "deepseek", 2, 8, [*EP2, "--parallelism.context_parallel_degree", "2"]),
    ("deepseek_ep2_pp2", "deepseek", 4, 4, [*EP2, *PP2]),
    ("deepseek_mtp_tp2", "deepseek_mtp", 2, 8, TP2),
    ("deepseek_mtp_ep2_fsdp2_compile", "deepseek_mtp", 4, 2, [*EP2, "--compile.enable"]),
    ("deepseek_hsdp2x2_ac", "deepseek", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                                               "--activation_checkpoint.mode", "full"]),
    ("gpt_oss_fsdp2", "gpt_oss", 2, 4, []),
    ("gpt_oss_tp2", "gpt_oss", 2, 8, TP2),
    ("gpt_oss_ep2", "gpt_oss", 2, 4, EP2),
    ("gpt_oss_ep2_fsdp2", "gpt_oss", 4, 2, EP2),
    ("gpt_oss_pp2", "gpt_oss", 2, 8, PP2),
    # CP 4 under the mask-aware order (the default balancer; these windows' documents make it differ from
    # head-tail, test_cp4_order_is_mask_aware): documents, sliding windows and sinks through the masked ring,
    # FSDP over the 4 CP ranks. (HSDP is in hsdp2x2, moe_hsdp2x2, moe_ep2_hsdp2x2 and deepseek_hsdp2x2_ac.)
    ("gpt_oss_documents_cp4", "gpt_oss_documents", 4, 8, ["--parallelism.context_parallel_degree", "4"]),
    ("gpt_oss_cp2", "gpt_oss", 2, 8, CP2),  # each layer runs the masked ring under its own mask: sliding or full
    ("gpt_oss_cp2_documents", "gpt_oss_documents", 2, 8, CP2),
]


CASES = [register(__name__, name, nproc, [*TINY_RUN, *FLAVORS[ref], "--training.local_batch_size", str(local_batch),
                                         *overrides], grads=True,
                  prepare=write_documents if ref.startswith("gpt_oss") else None)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, ref, nproc, overrides",
                         [(case, ref, nproc, overrides) for case, (_, ref, nproc, _, overrides) in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(references, worlds, world_case, ref, nproc, overrides):
    ref_losses, ref_init, ref_grads, ref_loads = references[ref]
    folder = worlds.folder(world_case)
    name = world_case.split("::")[1]
    assert_same_init(folder, nproc, ref_init)
    grad_diff, worst = worst_tensor_diff(gathered(folder, nproc, "grads"), ref_grads)
    got = losses(folder)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nLAYOUT {name:45s} procs {nproc}  max rel loss diff {diff:.2e}  "
          f"grad diff {grad_diff:.1e} ({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    tol = GRAD_TOL.get(ref, DEFAULT_GRAD_TOL)
    assert grad_diff <= tol, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    assert expert_loads(folder) == ref_loads, f"{name}: tokens per expert differ from one process"
    if ref in MOE_LAYERS:
        assert all(load and len(load) == MOE_LAYERS[ref] for load in ref_loads)  # every MoE layer, every step
    if ref in (*MOE_LAYERS, "gpt_oss", "gpt_oss_documents"):
        experts = json.loads((folder / "experts_rank0.json").read_text())
        ep = int(overrides[overrides.index(EP2[0]) + 1]) if EP2[0] in overrides else 1
        assert all(mesh.get("ep", 1) == ep for mesh in experts.values()) and (experts or ep == 1), experts


def test_documents_are_longer_and_shorter_than_the_window(tmp_path):
    """Else block_causal with a window would equal one of the two alone."""
    from titanctl.config.recipe import load_config
    from titanctl.data.dataloader import TokenWindowLoader
    from titanctl.data.datasets import load_documents
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS

    write_documents(tmp_path)
    cfg = load_config(None, [*TINY_RUN, *[a.replace(ROOT, str(tmp_path)) for a in DOCUMENTS]])
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    loader = TokenWindowLoader(load_documents("local", cfg.training.dataset_path), tokenizer,
                               seq_len=cfg.training.seq_len, global_batch_size=8, local_batch_size=8,
                               dp_rank=0, dp_degree=1, seed=cfg.training.seed)  # fmt: skip
    (inputs, _), = loader.next_step()
    window = GPT_OSS_FLAVORS["debugmodel"].sliding_window
    assert window < cfg.training.seq_len
    lengths = [len(run) for row in inputs.tolist() for run in _documents(row, tokenizer.bos_id)]
    assert min(lengths) < window < max(lengths), lengths


def test_cp4_order_is_mask_aware(worlds):
    """gpt_oss_documents_cp4's logged imbalance is the mask-aware order's of each step's batch (recomputed here
    from the same loader; logged to 4 decimals), below head-tail's: the case trains on an order other than head-tail's."""
    from titanctl.config.recipe import load_config
    from titanctl.data.dataloader import TokenWindowLoader
    from titanctl.data.datasets import load_documents
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS
    from titanctl.parallel.layouts.context_parallel import load_balanced_order
    from titanctl.parallel.layouts.cp_balance import imbalance, mask_aware_order
    from titanctl.train.attention_masks import MicrobatchMasks, layer_windows

    folder = worlds.folder(CASES[[layout[0] for layout in LAYOUTS].index("gpt_oss_documents_cp4")])
    cfg = load_config(None, [*TINY_RUN, *[a.replace(ROOT, str(worlds.root)) for a in DOCUMENTS]])
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    loader = TokenWindowLoader(load_documents("local", cfg.training.dataset_path), tokenizer,
                               seq_len=cfg.training.seq_len, global_batch_size=8, local_batch_size=8,
                               dp_rank=0, dp_degree=1, seed=cfg.training.seed)  # fmt: skip
    args = GPT_OSS_FLAVORS["debugmodel"].replace(n_layers=cfg.model.n_layers)
    masks = MicrobatchMasks(bos_id=tokenizer.bos_id, cp=4, window=args.sliding_window, windows=layer_windows(args))
    logged = [r["cp_imbalance"] for r in rows(folder)]
    assert len(logged) == 3
    for got in logged:
        (inputs, _), = loader.next_step()
        head_tail = imbalance(masks.rank_work(inputs, None, load_balanced_order(inputs.shape[1], 4)))
        mask_aware = imbalance(masks.rank_work(inputs, None, mask_aware_order(masks.work(inputs), 4)))
        assert got == pytest.approx(mask_aware, abs=1e-4) and mask_aware < head_tail - 0.05, (got, head_tail)


def _documents(row: list[int], bos: int) -> list[list[int]]:
    starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
    return [row[a:b] for a, b in zip(starts, starts[1:])]


def test_qwen3_tied_pipeline_is_refused_before_the_process_group_forms(tmp_path):
    proc = lone_rank(2, ["train", *TINY_RUN, *QWEN3, "--training.local_batch_size", "4", *PP2,
                         "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = "pipeline_parallel_degree = 2 with a model whose output layer is its embedding (tied, qwen3"
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "untied flavor" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- every schedule, one launch


def pp_args():
    from tests.distributed.workers import pp_worker
    from titanctl.models.qwen3.args import qwen3_args

    # Queries twice as wide as dim (4 heads x 32 over 64), as Qwen3's published sizes.
    return qwen3_args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn=128, tied=False, head_dim=32,
                      vocab_size=256).replace(max_seq_len=pp_worker.SEQ)


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("qwen3_pp") / "result.json"
    start = time.perf_counter()
    torchrun(2, [__file__], ["--schedules", ",".join(SCHEDULES), "--out", str(out)], timeout=300)
    results = json.loads(out.read_text())
    print(f"\nQWEN3 torchrun with {len(SCHEDULES)} pipeline schedules: {time.perf_counter() - start:.1f} s "
          f"(reference {results['reference_seconds']:.1f} s)")
    return results["cases"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_qwen3_pipeline_schedule_matches_one_process(pp_results, schedule):
    r = pp_results[schedule]
    rel = max_rel_diff(r["pp_losses"], r["ref_losses"])
    norm_rel = max_rel_diff(r["pp_norms"], r["ref_norms"])
    print(f"\nQWEN3 PP {schedule:22s} stages per rank {[g['stages'] for g in r['layout']]}, max rel loss diff "
          f"{rel:.2e}, grad-norm {norm_rel:.2e}, max |param diff| {r['max_param_diff']:.2e}, {r['seconds']:.2f} s")
    assert len(r["pp_losses"]) == PP_STEPS
    assert rel <= 1e-5, (r["pp_losses"], r["ref_losses"])
    assert norm_rel <= 1e-5, (r["pp_norms"], r["ref_norms"])
    assert r["max_param_diff"] <= 5e-4  # as test_pipeline.PARAM_TOL
    assert r["pp_losses"][-1] != r["pp_losses"][0]  # training moved


# ---------------------------------------------------------------- the torchrun script


if __name__ == "__main__":  # pp_worker with a Qwen3 model
    from tests.distributed.workers import pp_worker

    pp_worker.ARGS = pp_args()
    pp_worker.STEPS = PP_STEPS
    pp_worker.main()
