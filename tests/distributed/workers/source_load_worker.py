"""Load checkpoints of other formats into an FSDP2- or TP-sharded model; compare with DCP's load.

    torchrun --nproc_per_node 2 source_load_worker.py {fsdp|tp} DCP_FOLDER OUT FOLDER [FOLDER ...]

OUT/rank{r}.json: per FOLDER, whether every parameter's local shard equals the one DCP loaded
from DCP_FOLDER bit for bit, how many parameters are sharded, and how many were loaded.
"""

import json
import sys
import warnings
from pathlib import Path

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanctl.checkpoint.convert import open_checkpoint
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.cli.console import finish
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.data_parallel import apply_fsdp
from titanctl.parallel.layouts.tensor_parallel import apply_tp
from titanctl.parallel.runtime.env import init_process


def sharded_model(args, layout, mesh) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if layout == "fsdp":
        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                   reshard_after_forward="always", pipelined=False)
    else:
        apply_tp(model, mesh, loss_parallel=False, async_tp=False, compiled=False)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    return model


def local_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}


def main() -> None:
    layout, dcp_folder, out, *folders = sys.argv[1:]
    warnings.filterwarnings("ignore", message=".*_StridedShard.*")
    env = init_process(60)
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=(layout,))
    with open_checkpoint(dcp_folder) as source:
        args = source.args
    reference = sharded_model(args, layout, mesh)
    state = reference.state_dict()
    dcp.load(state, checkpoint_id=dcp_folder)
    want = local_params(reference)
    results = {}
    for folder in folders:
        model = sharded_model(args, layout, mesh)
        with open_checkpoint(folder) as source:
            report = load_source_into(model, source)
        got = local_params(model)
        results[folder] = {
            "equal": sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want),
            "loaded": len(report.loaded),
            "sharded": sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters()),
            "params": len(want),
        }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps(results))
    finish(0)


if __name__ == "__main__":
    main()
