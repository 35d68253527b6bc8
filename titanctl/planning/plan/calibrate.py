"""`titanctl plan --calibrate`: measure this machine as N training processes see it, for the cost model.

N processes start at once (as torchrun would start them: the cores shared out the same way, a gloo
process group between them) and measure together, so every figure includes the contention of N
processes on one host:

- matmul rate and its dependence on shape: fp32 (and bf16 where the CPU has bf16 units) matmuls of
  a dozen shapes; fitted to rate x prod(x / (x + half_dim)) over (M, N, K), the cost model's form;
- attention: causal ``scaled_dot_product_attention`` forward and backward, as FLOPs the model counts
  per second (its efficiency against the peak);
- memory bandwidth: a large elementwise add (bytes read and written per second);
- host time per operation: a chain of small autograd operations, forward and backward;
- collectives: all-gather, reduce-scatter, all-reduce, all-to-all and point-to-point over gloo at
  sizes from 4 KiB to 8 MiB, each fitted to the cost model's ring formula (latency per step and
  bandwidth);
- overlap: an all-gather issued asynchronously while matmuls run: how much of the shorter one hides;
- DTensor's host time: a linear on a sharded weight and an RMSNorm on a sharded activation, against
  the same plain ops (tensor and context parallel run on DTensors);
- a whole training step of a one-block Llama (eager fp32, titanctl's own model, linears and optimizer
  as train builds them), against what the cost model makes of the figures above for it: the ratio,
  ``compute_scale``, carries what the kernel-level figures miss when N processes train side by side.

The peak that efficiencies divide by is the trainer's own MFU peak (``titanctl.train.peak``: cores
x clock x FLOPs per cycle of the process's share of the cores). Everything is written to the cluster
file's ``[device]`` table (``devices.cluster_toml``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from titanctl.errors import ConfigError
from titanctl.host_memory import available_bytes
from titanctl.planning.plan.devices import Device, Link, cluster_toml

_MATMUL_SHAPES = [(m, n, k) for m in (256, 2048) for n, k in ((64, 256), (256, 256), (768, 256), (256, 768),
                                                             (1024, 1024))]
_ATTENTION_SHAPES = [(8, 16, 256, 16), (2, 16, 1024, 64)]  # (batch, heads, seq, head_dim)
# The step probe: a one-block Llama unlike the recipes' debug models (dim 384, 6 heads of 64, 2 KV heads).
_PROBE = {"dim": 384, "n_layers": 1, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 2048}
_PROBE_BATCH, _PROBE_SEQ = 2, 512
_SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]  # bytes of the whole (gathered) tensor
# The most processes that measure together on one host. Past 4 per core each has under a quarter of a
# core and waits its turn inside every timed collective: the figures describe the scheduler, not the
# machine (the distributed tests run at most 4 per core, 8 processes on 2). Each process holds torch and
# its probes: 0.5 GiB peak resident measured (2 processes, torch 2.13), so 0.6 GiB is asked of memory.
PROCESSES_PER_CORE = 4
PROCESS_MEMORY_GIB = 0.6


def _timed(fn, min_seconds: float = 0.15, repeats: int = 3) -> float:
    """Median seconds of one call of ``fn`` (after a warm-up call), each sample at least ``min_seconds``."""
    fn()
    samples = []
    for _ in range(repeats):
        calls, started = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def _timed_calls(fn, calls: int, repeats: int = 3) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` runs of ``calls`` calls. For collectives:
    every rank must make the same number of calls (a time-based loop would leave some waiting)."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls)
    return statistics.median(samples)


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _measure_compute(dtype) -> dict:
    import torch
    import torch.nn.functional as F

    out = {}
    times = []
    for m, n, k in _MATMUL_SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        _barrier()
        times.append(((m, n, k), _timed(lambda a=a, b=b: torch.mm(a, b))))
    out["matmul"] = times
    attention = []
    for batch, heads, seq, head_dim in _ATTENTION_SHAPES:
        q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        _barrier()
        seconds = _timed(step)
        counted = 12 * heads * head_dim * seq * batch * seq  # the model's count: 12 x H x d x T per token
        attention.append(counted / seconds)
    out["attention_flops"] = math.exp(statistics.fmean(math.log(x) for x in attention))
    return out


def _measure_host_and_memory() -> dict:
    import torch

    n = 8 << 20
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    _barrier()
    seconds = _timed(lambda: torch.add(a, b, out=c))
    bandwidth = 3 * 4 * n / seconds
    # A chain of tiny linears and activations, forward and backward: ~6 operations per link.
    layers = [torch.nn.Linear(8, 8) for _ in range(20)]
    x = torch.randn(4, 8)

    def chain():
        y = x
        for layer in layers:
            y = torch.relu(layer(y))
        y.sum().backward()

    _barrier()
    per_op = _timed(chain) / (len(layers) * 6 + 2)
    return {"memory_bandwidth": bandwidth, "op_seconds": per_op}


def _measure_collectives(world: int) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = rank ^ 1  # point-to-point pairs: 0-1, 2-3, ...
    out: dict[str, list[tuple[int, float]]] = {}
    for nbytes in _SIZES:
        numel = max(world, nbytes // 4 // world * world)
        full = torch.randn(numel)
        shard = torch.randn(numel // world)
        cases = {
            "all_gather": lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_to_all": lambda full=full: dist.all_to_all_single(torch.empty_like(full), full),
        }
        def p2p(full=full):
            if peer >= world:
                return
            ops = [dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, torch.empty_like(full), peer)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        cases["p2p"] = p2p
        calls = 20 if nbytes <= 64 << 10 else 8 if nbytes <= 1 << 20 else 3 if nbytes <= 8 << 20 else 1
        for kind, fn in cases.items():
            _barrier()
            out.setdefault(kind, []).append((numel * 4, _timed_calls(fn, calls)))
    return out


def _measure_dtensor(world: int) -> dict:
    """Host time that DTensor adds: a tiny linear on a column-sharded weight (forward and backward)
    and a tiny RMSNorm on a sequence-sharded activation (~10 elementwise ops), minus the plain ones."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8 * world, 8), mesh, [Shard(0)]))
    plain_weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8, requires_grad=True)
    norm_weight = torch.nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Replicate()]))
    plain_norm = torch.nn.Parameter(torch.ones(8))

    def linear():
        F.linear(DTensor.from_local(x, mesh, [Replicate()], run_check=False), weight).to_local().sum().backward()

    def plain_linear():
        F.linear(x, plain_weight).sum().backward()

    def rmsnorm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def norm():
        rmsnorm(DTensor.from_local(x, mesh, [Shard(0)], run_check=False), norm_weight).to_local().sum().backward()

    def plain():
        rmsnorm(x, plain_norm).sum().backward()

    times = {}
    for name, fn in (("linear", linear), ("plain_linear", plain_linear), ("norm", norm), ("plain", plain)):
        _barrier()
        times[name] = _timed_calls(fn, 20)
    return {"dtensor_linear": max(0.0, times["linear"] - times["plain_linear"]),
            "dtensor_op": max(0.0, times["norm"] - times["plain"]) / 10}


def _measure_overlap(dtype) -> float:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    full = torch.empty((4 << 20) // 4 // world * world)
    shard = torch.randn(full.numel() // world)

    def compute():
        for _ in range(8):
            torch.mm(a, b)

    def communicate():
        dist.all_gather_into_tensor(full, shard)

    def both():
        work = dist.all_gather_into_tensor(full, shard, async_op=True)
        compute()
        work.wait()

    _barrier()
    t_c = _timed_calls(compute, 5)
    _barrier()
    t_m = _timed_calls(communicate, 5)
    _barrier()
    t_both = _timed_calls(both, 5)
    return max(0.0, min(1.0, (t_c + t_m - t_both) / min(t_c, t_m)))


def _probe_args():
    from titanctl.models.registry import flavor_args

    return flavor_args("debugmodel").replace(**_PROBE, max_seq_len=_PROBE_SEQ)


def _measure_step() -> float:
    """Seconds of one training step (forward, backward, AdamW) of the probe model, as train runs it eagerly."""
    import torch
    import torch.nn.functional as F

    from titanctl.models.registry import build_model
    from titanctl.parallel.converters.onednn_linear import linear_kernel, use_onednn_linears
    from titanctl.parallel.layouts.weight_init import initialize_weights

    model = build_model(_probe_args())
    initialize_weights(model, seed=0)
    if linear_kernel("auto") == "onednn":
        use_onednn_linears(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, _PROBE["vocab_size"], (_PROBE_BATCH, _PROBE_SEQ + 1))

    def step():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _barrier()
    return _timed(step, min_seconds=0.5)


def predicted_probe_step(device: Device) -> float:
    """What the cost model predicts for the probe's step on ``device`` (its compute_scale left out)."""
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.cost_model import CostModel, Setting
    from titanctl.planning.plan.memory_model import Ranks
    from titanctl.planning.plan.workload import model_shape

    args = _probe_args()
    shape = model_shape(args)
    setting = Setting.of_model(dataclasses.replace(device, compute_scale=1.0), "float32", args, _PROBE_SEQ)
    single = Candidate(1, 1, 1, 1, 1, 1, _PROBE_BATCH, 1, ac="none")
    return CostModel(shape, setting).step_time(single, Ranks(shape), 4, 4, "default").step


def _worker(rank: int, world: int, port: int, result_path: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from titanctl.train.peak import cpu_peak

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the tensor collectives

    # As the trainer shares a host's cores among its processes (titanctl.parallel.runtime.env).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(rank)
    result = {"threads": torch.get_num_threads()}
    # The cost model fits matmul and attention efficiency on float32 and applies it to every dtype's peak.
    result["float32"] = _measure_compute(torch.float32)
    result.update(_measure_host_and_memory())
    result["collectives"] = _measure_collectives(world) if world > 1 else {}
    result["overlap"] = _measure_overlap(torch.float32) if world > 1 else 0.0
    result.update(_measure_dtensor(world) if world > 1 else {"dtensor_linear": 0.0, "dtensor_op": 0.0})
    result["probe_step"] = _measure_step()
    for dtype, name in ((torch.float32, "peak_float32"), (torch.bfloat16, "peak_bfloat16")):
        peak = cpu_peak(dtype, threads=torch.get_num_threads())
        result[name] = None if peak is None else peak.tflops
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(result_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    # As titanctl.cli.console.finish: gloo processes that built a DeviceMesh abort at interpreter exit
    # now and then (torch 2.13, "terminate called without an active exception"); leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_matmul(samples: list, peak: float) -> tuple[float, float]:
    """(efficiency, half_dim) that fit t = 2MNK / (peak x efficiency x prod(x / (x + half))) best
    (least squares on log times), given samples [((m, n, k), seconds)]."""
    best = None
    for half in [0.0] + [2 ** (i / 4) for i in range(41)]:  # 0 and 1 .. 1024
        logs = []
        for (m, n, k), seconds in samples:
            shape = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
            logs.append(math.log(2 * m * n * k / (seconds * peak * shape)))
        efficiency = math.exp(statistics.fmean(logs))
        error = sum((x - math.log(efficiency)) ** 2 for x in logs)
        if best is None or error < best[0]:
            best = (error, efficiency, half)
    return best[1], best[2]


def fit_link(kind: str, samples: list, world: int) -> Link:
    """Latency per ring step and bus bandwidth that fit the cost model's formula for ``kind`` best
    (least squares, both non-negative), given samples [(bytes of the whole tensor, seconds)]."""
    steps = 1 if kind == "p2p" else world - 1
    share = 1.0 if kind == "p2p" else (world - 1) / world
    factor = 2 if kind == "all_reduce" else 1
    xs = [(factor * steps, factor * share * nbytes) for nbytes, _ in samples]
    ys = [seconds for _, seconds in samples]
    # Normal equations of y = a x0 + b x1, then clamped to the feasible region.
    s00 = sum(x0 * x0 for x0, _ in xs)
    s01 = sum(x0 * x1 for x0, x1 in xs)
    s11 = sum(x1 * x1 for _, x1 in xs)
    t0 = sum(x0 * y for (x0, _), y in zip(xs, ys))
    t1 = sum(x1 * y for (_, x1), y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    latency, per_byte = ((s11 * t0 - s01 * t1) / det, (s00 * t1 - s01 * t0) / det) if det else (0.0, 0.0)
    if per_byte <= 0:
        per_byte = max(y / x1 for (_, x1), y in zip(xs, ys))
        latency = 0.0
    if latency < 0:
        latency = 0.0
        per_byte = t1 / s11
    return Link(1 / per_byte / 1e9, latency * 1e6)


def calibrate(processes: int, path: Path, log=print) -> str:
    """Measure with ``processes`` processes, write the cluster file, and return a one-line summary."""
    import torch.multiprocessing as mp

    check_processes(processes)
    check_writable(path)
    started = time.perf_counter()
    if log:
        log(f"calibrating with {processes} process(es) on {os.cpu_count()} core(s); about a minute or two ...")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "calibration.json")
        mp.start_processes(_worker, args=(processes, _free_port(), result_path), nprocs=processes,
                           start_method="spawn")
        ranks = json.loads(Path(result_path).read_text())
    device = device_from_measurements(ranks, processes)
    device = dataclasses.replace(device, compute_scale=statistics.median(r["probe_step"] for r in ranks)
                                 / predicted_probe_step(device))
    comments = [f"titanctl plan --calibrate with {processes} process(es), {datetime.date.today().isoformat()}, "
                f"{time.perf_counter() - started:.0f} s; {_cpu_name()}"]
    path.write_text(cluster_toml(device, comments))
    return (f"matmul {device.matmul_efficiency * device.peak_fp32_tflops * 1e3:.1f} GFLOP/s per process (fp32, "
            f"half-dim {device.matmul_half_dim:.0f}), memory {device.memory_bandwidth_gbps:.1f} GB/s, all-gather "
            f"{device.link('all_gather', False).gbps:.2f} GB/s + {device.link('all_gather', False).latency_us:.0f} us, "
            f"overlap {device.overlap:.2f}, {device.op_overhead_us:.1f} us per op, "
            f"compute x{device.compute_scale:.2f} (a training step against its figures), "
            f"DTensor +{device.dtensor_linear_us:.0f} "
            f"us per linear and +{device.dtensor_op_us:.0f} us per op")


def check_processes(processes: int) -> None:
    """One line, before any process starts, for a count this host cannot measure with."""
    if processes < 1:
        raise ConfigError(f"--gpus must be at least 1 to calibrate, got {processes}")
    cores = os.cpu_count() or 1
    if processes > PROCESSES_PER_CORE * cores:
        raise ConfigError(
            f"--gpus {processes:,}: the calibration runs that many processes at once on this host's {cores} core(s); "
            f"at most {PROCESSES_PER_CORE * cores} ({PROCESSES_PER_CORE} per core): more would measure how the "
            "processes take turns, not the machine"
        )
    available = available_bytes()
    if available is not None and processes * PROCESS_MEMORY_GIB * 2**30 > available:
        most = max(1, int(available / (PROCESS_MEMORY_GIB * 2**30)))
        raise ConfigError(
            f"--gpus {processes}: {processes} measuring processes need about {processes * PROCESS_MEMORY_GIB:.1f} GiB "
            f"({PROCESS_MEMORY_GIB} GiB each), this host has {available / 2**30:.1f} GiB available: at most {most}"
        )


def check_writable(path: Path) -> None:
    """--cluster must be a file that can be written, said before minutes of measuring."""
    if path.is_dir():
        raise ConfigError(f"--cluster {path} is a folder: give the file to write, e.g. {path / 'cpu.toml'}")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"--cluster {path}: folder {folder} does not exist (create it, or write elsewhere)")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"--cluster {path}: cannot write there (permission denied)")


def device_from_measurements(ranks: list[dict], processes: int) -> Device:
    """A ``Device`` from every rank's measurements (medians over ranks)."""

    def median(key):
        return statistics.median(r[key] for r in ranks)

    first = ranks[0]
    peak32 = first["peak_float32"]
    samples32 = [((m, n, k), statistics.median(r["float32"]["matmul"][i][1] for r in ranks))
                 for i, ((m, n, k), _) in enumerate(first["float32"]["matmul"])]
    if not peak32:  # no figure from the OS: the best rate measured stands for the peak
        peak32 = max(2 * m * n * k / s for (m, n, k), s in samples32) / 1e12
    op_seconds = median("op_seconds")
    # The fit is of the matmul itself: the host time of the call is the cost model's own term.
    efficiency, half = fit_matmul([(shape, max(s - op_seconds, s / 2)) for shape, s in samples32], peak32 * 1e12)
    peak16 = first["peak_bfloat16"] or peak32
    attention = statistics.median(r["float32"]["attention_flops"] for r in ranks) / (peak32 * 1e12)
    collectives = {}
    if processes > 1:
        for kind in first["collectives"]:
            samples = [(nbytes, statistics.median(r["collectives"][kind][i][1] for r in ranks))
                       for i, (nbytes, _) in enumerate(first["collectives"][kind])]
            collectives[kind] = fit_link(kind, samples, processes)
    reference = collectives.get("all_gather", Link(1e3, 0.0))
    memory_gib = _memory_total() / processes / 2**30
    return Device(
        name="cpu", peak_bf16_tflops=peak16, peak_fp8_tflops=0.0, peak_fp32_tflops=peak32, memory_gib=memory_gib,
        memory_bandwidth_gbps=median("memory_bandwidth") / 1e9, intra_node_gbps=reference.gbps,
        intra_node_latency_us=reference.latency_us, inter_node_gbps=reference.gbps,
        inter_node_latency_us=reference.latency_us, gpus_per_node=processes, matmul_efficiency=min(1.0, efficiency),
        matmul_half_dim=half, attention_efficiency=min(1.0, attention), collective_efficiency=1.0,
        overlap=median("overlap"), op_overhead_us=op_seconds * 1e6,
        dtensor_linear_us=median("dtensor_linear") * 1e6, dtensor_op_us=median("dtensor_op") * 1e6,
        host_runs_ahead=False, memory_reserve_gib=0.25, cores_per_process=min(1.0, (os.cpu_count() or 1) / processes),
        async_tp=False, target="cpu", collectives=collectives,
        source=f"measured by titanctl plan --calibrate ({processes} processes, {first['threads']} thread(s) each)",
    )


def _memory_total() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
