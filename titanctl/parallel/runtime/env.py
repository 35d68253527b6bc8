"""The process's place in the job: device, process group, threads, which ranks print."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanctl.errors import TitanError
from titanctl.parallel.runtime import elastic, hang_watchdog, peers


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


def read_layout() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables, each checked
    before any rendezvous: a rank that cannot exist (``RANK`` >= ``WORLD_SIZE``) waited for peers
    until the timeout, and ``WORLD_SIZE=abc`` ended in a traceback. One-line TitanErrors."""
    world_size = elastic.int_from_env("WORLD_SIZE", 1, minimum=1)
    rank = elastic.int_from_env("RANK", 0, minimum=0)
    local_world_size = elastic.int_from_env("LOCAL_WORLD_SIZE", 1, minimum=1)
    local_rank = elastic.int_from_env("LOCAL_RANK", 0, minimum=0)
    for name, value, bound_name, bound in (
        ("RANK", rank, "WORLD_SIZE", world_size),
        ("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size),
    ):
        if value >= bound:
            raise TitanError(
                f"environment variable {name} is {value} but {bound_name} is {bound}: expected 0 <= {name} < "
                f"{bound_name} (torchrun sets both)"
            )
    if local_world_size > world_size:
        raise TitanError(
            f"environment variable LOCAL_WORLD_SIZE is {local_world_size} but WORLD_SIZE is {world_size}: a host "
            "cannot run more processes than the job has"
        )
    if world_size > 1:  # the env:// rendezvous needs both
        if not os.environ.get("MASTER_ADDR"):
            raise TitanError(
                f"environment variable MASTER_ADDR is not set but WORLD_SIZE is {world_size}: launch with torchrun"
            )
        elastic.int_from_env("MASTER_PORT", None, minimum=1, maximum=65535)
    elastic.Attempt.from_env()  # its counters too, before anything is written
    return rank, local_rank, world_size, local_world_size


def init_process(timeout_seconds: int, trace_buf_size: int = 0, flight_recorder_folder=None) -> ProcessEnv:
    """Read torchrun's environment, pick the device and backend, start the process group.

    ``trace_buf_size`` > 0 makes the Flight Recorder keep that many collectives per group. Under
    ``torchrun --max-restarts`` every attempt rendezvouses under its own store prefix
    (``titanctl.parallel.runtime.elastic``), so a restart never reads the dead attempt's addresses.
    """
    rank, local_rank, world_size, local_world_size = read_layout()
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Processes on one host share its cores; oversubscribing them is much slower.
        if "OMP_NUM_THREADS" not in os.environ or local_world_size > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if world_size > 1 and not dist.is_initialized():
        hang_watchdog.enable(trace_buf_size, flight_recorder_folder)  # before the group exists
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = elastic.attempt_store(world_size, timeout)
        where = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
        with peers.connecting():
            dist.init_process_group(
                backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **where
            )
    return ProcessEnv(rank, local_rank, world_size, local_world_size, device)


# cuBLAS reduces in a fixed order only with a fixed workspace; without this setting torch raises
# at the first CUDA matmul once deterministic algorithms are on (torch.use_deterministic_algorithms).
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def use_deterministic_algorithms(device: torch.device) -> None:
    """training.deterministic: torch's deterministic kernels, and on CUDA the cuBLAS workspace they need
    (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts: before the first matmul; one set by the user is kept)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
