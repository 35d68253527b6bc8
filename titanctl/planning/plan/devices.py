"""What the planner knows about a machine: its compute, memory and links, as one ``Device``.

A device is either a published preset (GPU datasheets, below, each figure with its source) or a
cluster file (``--cluster FILE.toml``: one ``[device]`` table with the same keys, written by
``titanctl plan --calibrate`` from measurements, or by hand). Command-line figures override both.

Figures are per GPU (per process for a CPU "device": the calibration measures what one of N
processes sharing the host gets). Bandwidths are per direction, in GB/s (1e9 bytes/s).

The efficiencies of GPU presets are assumptions, not measurements of this project
(docs/memory-and-planning.md lists them): large bf16 GEMMs reach about 70-80% of the dense peak on
H100/A100 in cuBLAS; FlashAttention-2 reaches about 35-50% of the peak forward and backward; NCCL ring collectives reach
about 80% of the link's bandwidth as bus bandwidth on large messages. Three are set by torchtitan's
published H100 measurements (``published.py``; ``benchmarks/plan_published.py`` compares them all):
Float8 matmuls at 0.60 of the fp8 peak (Float8 bought 1.28x on the 8B), async TP hiding a quarter
of TP's collectives (1.057x on the 70B), and FSDP's prefetch hiding 97% of what fits behind compute
(8 -> 128 GPUs cost the 8B 1.8%). ``--calibrate`` replaces them with measured ones on the machine
it runs on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from titanctl.errors import ConfigError

# Collective kinds the cost model times; each has a bandwidth (GB/s, per direction per rank, as
# "bus bandwidth": the ring formulas' bytes per second) and a latency per ring step (us).
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


@dataclass(frozen=True)
class Link:
    gbps: float  # bus bandwidth per direction per rank
    latency_us: float  # per message / ring step


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16_tflops: float  # dense, no sparsity
    peak_fp8_tflops: float  # 0: no float8 units (the plan then never proposes Float8)
    peak_fp32_tflops: float  # plain fp32 matmuls (recipes with mixed_precision_param float32)
    memory_gib: float  # per device
    memory_bandwidth_gbps: float  # HBM (or DRAM share per process)
    intra_node_gbps: float  # per direction per GPU (NVLink / Infinity Fabric; CPU: measured gloo)
    intra_node_latency_us: float
    inter_node_gbps: float  # per direction per GPU (the GPU's NIC)
    inter_node_latency_us: float
    gpus_per_node: int
    # Efficiencies (0-1) and overheads: assumptions for GPUs, measured by --calibrate.
    matmul_efficiency: float = 0.75  # of the peak, for large matmuls
    float8_matmul_efficiency: float = 0.60  # of the fp8 peak, for large Float8 matmuls (scaled, from bf16)
    matmul_half_dim: float = 96.0  # a matmul dim this size halves the efficiency (tiles, waves)
    attention_efficiency: float = 0.40  # FLOPs counted as the model counts them / (time x peak)
    collective_efficiency: float = 0.80  # bus bandwidth / link bandwidth for the preset links
    overlap: float = 0.97  # share of overlappable communication hidden behind compute
    async_tp_overlap: float = 0.25  # share of TP's collectives that async TP hides behind its matmuls
    op_overhead_us: float = 6.0  # host time per kernel launched
    # DTensor (TP's sharded weights, SP's sharded norms, CP's attention): extra host time of one linear's
    # forward and backward on a sharded weight, and of one elementwise op on a DTensor, beyond plain ops.
    dtensor_linear_us: float = 150.0
    dtensor_op_us: float = 40.0
    # Measured compute of a training step / what the figures above predict for it (calibration's step
    # probe); it multiplies every compute term. 1 for presets: their figures are all there is.
    compute_scale: float = 1.0
    host_runs_ahead: bool = True  # GPUs: the host queues kernels while earlier ones run
    # Compute units per process: 1 for GPUs; a CPU host running more processes than cores shares
    # them, so a process that waits (a pipeline bubble) leaves its share to the others.
    cores_per_process: float = 1.0
    memory_reserve_gib: float = 3.0  # CUDA context, NCCL/cuBLAS workspaces, allocator slack
    async_tp: bool = False  # symmetric-memory async TP (needs CUDA SM90 and NVLink)
    target: str = "cuda"  # what estimate-memory models: cuda or cpu
    # Measured per-collective figures (calibration): kind -> Link, for the intra-node link.
    collectives: dict[str, Link] = field(default_factory=dict)
    source: str = ""  # where the figures come from

    def peak_tflops(self, dtype: str, float8: bool = False) -> float:
        if float8 and self.peak_fp8_tflops:
            return self.peak_fp8_tflops
        return self.peak_fp32_tflops if dtype == "float32" else self.peak_bf16_tflops

    def link(self, kind: str, inter_node: bool) -> Link:
        """Bandwidth and latency of a collective of ``kind`` over the node's links or the network."""
        if inter_node:
            return Link(self.inter_node_gbps * self.collective_efficiency, self.inter_node_latency_us)
        if kind in self.collectives:
            return self.collectives[kind]
        return Link(self.intra_node_gbps * self.collective_efficiency, self.intra_node_latency_us)


# Published figures. Sources:
# - H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s bf16 dense (1,979 with
#   sparsity), 1,979 fp8 dense, 67 fp32, 3.35 TB/s HBM3; NVLink 4 900 GB/s bidirectional, i.e.
#   450 GB/s per direction; DGX H100: 8 GPUs and 8 ConnectX-7 400 Gb/s NICs (50 GB/s per GPU).
# - H200 SXM 141GB: NVIDIA H200 datasheet: same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
#   NVLink 900 GB/s; HGX H200 with 400 Gb/s per GPU.
# - B200 (HGX/DGX B200): NVIDIA DGX B200 datasheet: 72 PFLOP/s fp8 training and 1,440 GB HBM3e at
#   64 TB/s for 8 GPUs, i.e. 4,500 TFLOP/s fp8 and 2,250 bf16 dense, 180 GB and 8 TB/s per GPU;
#   NVLink 5 1.8 TB/s bidirectional (900 per direction); 8 x 400 Gb/s ConnectX-7.
# - A100 SXM4 80GB: NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, no fp8, 19.5 fp32, 2,039 GB/s;
#   NVLink 3 600 GB/s bidirectional (300 per direction); DGX A100: 8 x 200 Gb/s HDR (25 GB/s per GPU).
# - MI300X: AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s bf16 dense, 2,614.9 fp8 dense, 163.4
#   fp32 matrix, 192 GB HBM3 at 5.3 TB/s; 896 GB/s aggregate Infinity Fabric peer bandwidth
#   (7 links x 64 GB/s x 2 directions: 448 per direction); platforms with 400 Gb/s per GPU.
# Latencies are assumptions: a few microseconds per NCCL ring step over NVLink, ~10 over IB.
PRESETS: dict[str, Device] = {
    "h100": Device(
        "h100", peak_bf16_tflops=989.0, peak_fp8_tflops=1979.0, peak_fp32_tflops=67.0, memory_gib=80e9 / 2**30,
        memory_bandwidth_gbps=3350.0, intra_node_gbps=450.0, intra_node_latency_us=3.0, inter_node_gbps=50.0,
        inter_node_latency_us=10.0, gpus_per_node=8, async_tp=True, source="NVIDIA H100 SXM5 datasheet",
    ),
    "h200": Device(
        "h200", peak_bf16_tflops=989.0, peak_fp8_tflops=1979.0, peak_fp32_tflops=67.0, memory_gib=141e9 / 2**30,
        memory_bandwidth_gbps=4800.0, intra_node_gbps=450.0, intra_node_latency_us=3.0, inter_node_gbps=50.0,
        inter_node_latency_us=10.0, gpus_per_node=8, async_tp=True, source="NVIDIA H200 SXM datasheet",
    ),
    "b200": Device(
        "b200", peak_bf16_tflops=2250.0, peak_fp8_tflops=4500.0, peak_fp32_tflops=75.0, memory_gib=180e9 / 2**30,
        memory_bandwidth_gbps=8000.0, intra_node_gbps=900.0, intra_node_latency_us=3.0, inter_node_gbps=50.0,
        inter_node_latency_us=10.0, gpus_per_node=8, async_tp=True, source="NVIDIA DGX B200 datasheet",
    ),
    "a100": Device(
        "a100", peak_bf16_tflops=312.0, peak_fp8_tflops=0.0, peak_fp32_tflops=19.5, memory_gib=80e9 / 2**30,
        memory_bandwidth_gbps=2039.0, intra_node_gbps=300.0, intra_node_latency_us=3.0, inter_node_gbps=25.0,
        inter_node_latency_us=10.0, gpus_per_node=8, source="NVIDIA A100 SXM4 80GB datasheet",
    ),
    "mi300x": Device(
        "mi300x", peak_bf16_tflops=1307.4, peak_fp8_tflops=2614.9, peak_fp32_tflops=163.4,
        memory_gib=192e9 / 2**30, memory_bandwidth_gbps=5300.0, intra_node_gbps=448.0, intra_node_latency_us=4.0,
        inter_node_gbps=50.0, inter_node_latency_us=10.0, gpus_per_node=8, source="AMD Instinct MI300X datasheet",
    ),
}
# Devices that have no published figures: only a calibration (or a cluster file) gives them.
UNPUBLISHED = ("cpu",)
DEVICE_NAMES = (*PRESETS, *UNPUBLISHED)

# Device fields a cluster file and the command line may set (the rest: name, collectives, source).
_NUMBERS = {f.name: f.type for f in dataclasses.fields(Device)
            if f.name not in ("name", "collectives", "source", "target")}


def _check_number(key: str, value, where: str):
    kind = _NUMBERS[key]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}{where} must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r}{where} must be a finite number")
    if kind == "int":
        if value != int(value) or value < 1:
            raise ConfigError(f"{key} = {value!r}{where} must be a whole number >= 1")
        return int(value)
    if value < 0:
        raise ConfigError(f"{key} = {value!r}{where} must not be negative")
    if key.endswith("efficiency") and not 0 < value <= 1:
        raise ConfigError(f"{key} = {value!r}{where} must be a fraction in (0, 1]")
    if key.endswith("overlap") and value > 1:
        raise ConfigError(f"{key} = {value!r}{where} must be a fraction in [0, 1]")
    return float(value)


def load_cluster(path: Path) -> dict:
    """The ``[device]`` table of a cluster file, checked: {key: value} (collectives as Links)."""
    from titanctl.safe_io import parse_toml, read_bytes

    if not path.is_file():
        raise ConfigError(f"cluster file not found: {path}")
    text = read_bytes(path, what="cluster file", max_bytes=1 << 20, error=ConfigError).decode("utf-8", "replace")
    data = parse_toml(text, what=str(path), error=ConfigError)
    table = data.get("device")
    if not isinstance(table, dict):
        raise ConfigError(f"cluster file {path} has no [device] table (run titanctl plan --calibrate to write one)")
    where = f" in {path}"
    out: dict = {}
    for key, value in table.items():
        if key in ("name", "source", "target"):
            if not isinstance(value, str):
                raise ConfigError(f"{key} = {value!r}{where} must be a string")
            if key == "target" and value not in ("cuda", "cpu"):
                raise ConfigError(f"target = {value!r}{where} must be cuda or cpu")
            out[key] = value
        elif key == "collectives":
            if not isinstance(value, dict):
                raise ConfigError(f"[device.collectives]{where} must be a table")
            links = {}
            for kind, link in value.items():
                if kind not in COLLECTIVES or not isinstance(link, dict) or set(link) != {"gbps", "latency_us"}:
                    raise ConfigError(
                        f"[device.collectives] {kind}{where}: expected one of {', '.join(COLLECTIVES)} "
                        "= {gbps = ..., latency_us = ...}"
                    )
                gbps = _check_number("intra_node_gbps", link["gbps"], where)
                latency = _check_number("intra_node_latency_us", link["latency_us"], where)
                if gbps <= 0:
                    raise ConfigError(f"[device.collectives] {kind}.gbps{where} must be positive")
                links[kind] = Link(gbps, latency)
            out["collectives"] = links
        elif key in _NUMBERS:
            out[key] = _check_number(key, value, where)
        else:
            raise ConfigError(f"unknown key {key!r} in the [device] table of {path}; valid: {', '.join(_NUMBERS)}")
    return out


def resolve_device(name: str | None, cluster: Path | None, figures: dict) -> Device:
    """The device from a preset name, a cluster file and command-line ``figures`` (later wins).

    A device needs every figure: an unpublished one (cpu) without a cluster file is an error that
    says how to get one.
    """
    fields: dict = {}
    from_file = load_cluster(cluster) if cluster is not None else {}
    device_name = name or from_file.get("name")
    if device_name is None:
        raise ConfigError(f"give --device ({', '.join(DEVICE_NAMES)}) or --cluster FILE.toml")
    if device_name in PRESETS and (name is None or from_file.get("name") in (None, name)):
        fields = dataclasses.asdict(PRESETS[device_name])
        fields["collectives"] = {}
    elif name is not None and from_file.get("name") not in (None, name):
        raise ConfigError(
            f"--device {name} but the cluster file {cluster} describes {from_file['name']!r}: give one of them"
        )
    fields.update(from_file)
    fields["name"] = device_name
    fields.update({k: _check_number(k, v, " on the command line") for k, v in figures.items() if v is not None})
    required = [f.name for f in dataclasses.fields(Device) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in fields]
    if missing:
        how = ("run `titanctl plan --calibrate --cluster FILE.toml --gpus N` on the machine to measure it"
               if device_name in UNPUBLISHED else "pass them on the command line or in --cluster FILE.toml")
        if device_name not in PRESETS and device_name not in UNPUBLISHED and not from_file:
            raise ConfigError(
                f"unknown --device {device_name!r}: choose one of {', '.join(DEVICE_NAMES)}, or describe it "
                "with --cluster FILE.toml"
            )
        raise ConfigError(f"device {device_name!r} has no figures for {', '.join(missing)}: {how}")
    for key in ("peak_bf16_tflops", "memory_gib", "memory_bandwidth_gbps", "intra_node_gbps", "inter_node_gbps",
                "compute_scale"):
        if fields[key] <= 0:
            raise ConfigError(f"device {device_name!r}: {key} must be positive, got {fields[key]}")
    return Device(**fields)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)  # exact: the file reads back as the same figures
    return str(value)


def cluster_toml(device: Device, comments: list[str]) -> str:
    """A cluster file describing ``device`` (``load_cluster`` reads it back)."""
    lines = [f"# {c}" for c in comments] + ["[device]"]
    for f in dataclasses.fields(Device):
        if f.name != "collectives":
            lines.append(f"{f.name} = {_toml_value(getattr(device, f.name))}")
    if device.collectives:
        lines.append("")
        lines.append("[device.collectives]  # measured: bus bandwidth per rank and latency per ring step")
        for kind, link in device.collectives.items():
            lines.append(f"{kind} = {{gbps = {_toml_value(link.gbps)}, latency_us = {_toml_value(link.latency_us)}}}")
    return "\n".join(lines) + "\n"
