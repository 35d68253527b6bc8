"""LoRA under FSDP, TP (with sequence and loss parallel), PP, FSDP x TP and, for adapters on routed
experts, EP: each layout starts from the same base and adapters bit for bit, gives every adapter the
first step's gradient of one process, no gradient to any base weight, and per-step losses within 1e-5
relative of one process, on real torchrun + gloo.

The cases run in the shared torchrun worlds (tests/distributed/worlds.py). Their base is a titanctl
checkpoint of Qwen3's debug shapes, written before the worlds start (``write_bases``) and loaded through
``checkpoint.initial_load_path``, as a LoRA run starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import TINY_RUN, assert_same_init, gathered, init_digests, losses, max_rel_diff
from tests.distributed.worlds import ROOT, register
from titanctl.parallel.converters.lora import is_adapter

QWEN3_UNTIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"]
QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
ADAPTERS = {
    # Every linear of the blocks and the (untied) output layer: column- and row-wise splits, loss parallel.
    "dense": [*QWEN3_UNTIED, "--lora.target_modules", "attention,feed_forward,output", "--lora.rank", "4"],
    # Per-expert adapters on the routed experts' three stacks, and the queries.
    "moe": [*QWEN3_MOE, "--lora.target_modules", "attention.wq,moe.experts", "--lora.rank", "8"],
}


def base_folder(root: Path, name: str) -> Path:
    return root / f"lora_base_{name}"


def write_bases(root: Path) -> None:
    """Each reference's base: its model, initialized with another seed than the runs', as a titanctl checkpoint."""
    from titanctl.checkpoint.convert import save_state_dict
    from titanctl.config.recipe import load_config
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.models.registry import build_model, model_args_from_config
    from titanctl.parallel.layouts.weight_init import initialize_weights

    for name, flavor in ADAPTERS.items():
        if base_folder(root, name).exists():
            continue
        cfg = load_config(None, [*TINY_RUN, *flavor[:4]])
        args = model_args_from_config(cfg.model, Tokenizer().vocab_size, cfg.training.seq_len)
        model = build_model(args)
        initialize_weights(model, seed=7)
        save_state_dict(model.state_dict(), args, base_folder(root, name), "dcp")


def lora_run(name: str, local_batch: int, overrides: list[str]) -> list[str]:
    return [*TINY_RUN, *ADAPTERS[name], "--lora.enable", "--lora.alpha", "8", "--optimizer.lr", "1e-2",
            "--training.local_batch_size", str(local_batch),
            "--checkpoint.initial_load_path", str(base_folder(Path(ROOT), name)), *overrides]


REFERENCES = {name: register(__name__, f"single_{name}", 1, lora_run(name, 8, []), grads=True, always=True,
                             prepare=write_bases) for name in ADAPTERS}

# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", "dense", 2, 4, []),
    ("tp2_sp_loss_parallel", "dense", 2, 8, TP2),
    ("pp2", "dense", 2, 8, [*PP2, "--parallelism.data_parallel_shard_degree", "1"]),
    ("fsdp2_tp2", "dense", 4, 4, TP2),
    ("moe_ep2", "moe", 2, 4, EP2),
]
CASES = [register(__name__, name, nproc, lora_run(ref, local_batch, overrides), grads=True, prepare=write_bases)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]
GRAD_TOL = 1e-4  # of the tensor's largest gradient; a tensor whose gradient is zero must stay zero




@pytest.fixture(scope="module")
def references(worlds) -> dict:
    return {name: (losses(folder := worlds.folder(key)), init_digests(folder, 1), gathered(folder, 1, "grads"))
            for name, key in REFERENCES.items()}


@pytest.mark.parametrize("world_case, ref, nproc", [(case, ref, nproc) for case, (_, ref, nproc, _, _)
                                                   in zip(CASES, LAYOUTS)], ids=[layout[0] for layout in LAYOUTS])
def test_lora_layout_matches_single_process(references, worlds, world_case, ref, nproc):
    ref_losses, ref_init, ref_grads = references[ref]
    folder = worlds.folder(world_case)
    assert_same_init(folder, nproc, ref_init)
    grads = gathered(folder, nproc, "grads")
    assert set(grads) == set(ref_grads) and grads and all(is_adapter(k) for k in grads), \
        "a base weight got a gradient, or an adapter none"
    diffs = {}
    for key, g in ref_grads.items():
        largest = g.abs().max().item()
        diffs[key] = (grads[key] - g).abs().max().item() / largest if largest else grads[key].abs().max().item()
    worst = max(diffs, key=diffs.get)
    got = losses(folder)
    diff = max_rel_diff(got, ref_losses)
    name = world_case.split("::")[1]
    print(f"\nLORA LAYOUT {name:24s} procs {nproc}  max rel loss diff {diff:.2e}  grad diff {diffs[worst]:.1e} "
          f"({worst})  {len(grads)} adapters")
    assert any(g.abs().max() > 0 for k, g in ref_grads.items() if k.endswith("lora_b"))
    assert diffs[worst] <= GRAD_TOL, f"{name}: first-step gradient of {worst} off by {diffs[worst]:.2e}"
    assert len(got) == 3 and got[-1] != got[0]
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
