"""torchao's float8 TP styles, as the TP plan applies them, on a 1-rank TP mesh (gloo).

gloo has no float8 dtypes, so a 2-rank gloo run all-gathers activations in high precision with
the plain styles; with one rank no collective moves data and the float8 styles' own code (cast
before the gather, float8 gradients) runs for real. Writes JSON: the styles of a block, the loss
and a gradient of the TP model against the same float8 model without TP.

    torchrun --standalone --nproc_per_node 1 float8_tp_styles_worker.py OUT_JSON
"""

import copy
import json
import sys

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from titanctl.cli.console import finish
from titanctl.config.job_config import Float8
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.tp_plan import block_plan, root_plan
from titanctl.parallel.converters.float8 import convert_to_float8, float8_tp_styles, is_float8_linear
from titanctl.parallel.layouts.weight_init import initialize_weights

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


def main() -> None:
    dist.init_process_group("gloo")
    model = Transformer(ARGS)
    initialize_weights(model, 0)
    convert_to_float8(model, Float8(), tp=1, device=torch.device("cpu"))
    reference = copy.deepcopy(model)

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, root_plan(loss_parallel=True))
    styles = {}
    for block in model.layers.values():
        names = [name for name, m in block.named_modules() if is_float8_linear(m)]
        plan = block_plan(float8_tp_styles(), names)
        styles = {name: type(style).__name__ for name, style in plan.items()}
        parallelize_module(block, mesh, plan)

    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten())
    ref_loss.backward()
    grad = model.layers["0"].feed_forward.w1.weight.grad.full_tensor()
    ref_grad = reference.layers["0"].feed_forward.w1.weight.grad
    result = {
        "styles": styles,
        "loss": loss.full_tensor().item(),
        "reference_loss": ref_loss.item(),
        "grad_max_abs_diff": (grad - ref_grad).abs().max().item(),
        "grad_max_abs": ref_grad.abs().max().item(),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (gloo can abort at a plain exit)
