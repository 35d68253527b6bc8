"""The process's place in the job: device, process group, threads, which ranks print."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ProcessEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_process(timeout_seconds: int, trace_buf_size: int = 0, flight_recorder_folder=None) -> ProcessEnv:
    """Read torchrun's environment, pick the device and backend, start the process group.

    ``trace_buf_size`` > 0 makes the Flight Recorder keep that many collectives per group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Processes on one host share its cores; oversubscribing them is much slower.
        if "OMP_NUM_THREADS" not in os.environ or local_world_size > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if world_size > 1 and not dist.is_initialized():
        from titanctl.parallel import hang_watchdog

        hang_watchdog.enable(trace_buf_size, flight_recorder_folder)  # before the group exists
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_seconds),
            device_id=device if device.type == "cuda" else None,
        )
    return ProcessEnv(rank, local_rank, world_size, local_world_size, device)
