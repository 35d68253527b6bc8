"""The shared-memory all-gather of inference tensor parallel, checked against gloo's under torchrun.

    torchrun --nproc_per_node N shm_exchange_worker.py OUT

OUT/rank{r}.json: {"rounds": how many gathers matched gloo's, "large_via_gloo": bool,
"leftover_segments": files of this job left in the segment folder, "fallback": what ``create``
returned when one rank could not map the segment}.
"""

import json
import os
import sys
from pathlib import Path

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

import torch
import torch.distributed as dist

from titanctl.cli.console import finish
from titanctl.inference import shm_exchange
from titanctl.inference import tensor_parallel as inference_tp
from titanctl.parallel.runtime.env import init_process


def piece(rank: int, round_: int) -> torch.Tensor:
    """A different shape, dtype and content per round, the same shape on every rank."""
    dtype = (torch.float32, torch.bfloat16, torch.int64)[round_ % 3]
    shape = (1, 1 + round_ % 4, 8 + 24 * (round_ % 5))
    values = torch.arange(torch.Size(shape).numel()).reshape(shape) * (rank + 1) + round_
    return values.to(dtype)


def main() -> None:
    out = Path(sys.argv[1])
    env = init_process(60)
    group = dist.group.WORLD
    exchange = shm_exchange.create(group)
    assert exchange is not None, "ranks of one host must share a segment"
    gather = inference_tp.RankGather(group, env.world_size, exchange)
    maker = [os.getpid()]
    dist.broadcast_object_list(maker, src=0)  # rank 0 made the segment and names it after its pid
    dist.barrier()  # rank 0 removes the file after every rank said it mapped it
    leftover = sorted(p.name for p in shm_exchange._segment_folder().glob(f"titanctl-tp-{maker[0]}-*"))
    rounds = 0
    for round_ in range(300):  # many rounds: both banks reused, the counters far past the first
        x = piece(env.rank, round_)
        expected = [torch.empty_like(x) for _ in range(env.world_size)]
        dist.all_gather(expected, x)
        got = gather(x)
        assert torch.equal(got, torch.stack(expected)), round_
        rounds += 1
    large = torch.full((1, 1, shm_exchange.SLOT_BYTES // 4 + 1), float(env.rank))
    assert not exchange.fits(large.numel() * large.element_size())
    gathered = gather(large)
    large_via_gloo = torch.equal(gathered[:, 0, 0, 0], torch.arange(env.world_size, dtype=torch.float32))

    # A rank that cannot map the segment (another host, a full /dev/shm): every rank falls back.
    if env.rank == 1:
        shm_exchange._map_segment = lambda *args: None
    fallback = shm_exchange.create(group)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{env.rank}.json").write_text(json.dumps({
        "rounds": rounds, "large_via_gloo": large_via_gloo, "leftover_segments": leftover,
        "fallback": repr(fallback),
    }))


if __name__ == "__main__":
    main()
    finish(0)
