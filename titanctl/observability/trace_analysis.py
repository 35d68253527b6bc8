"""torch.profiler Chrome/Perfetto traces: where the time goes, per rank and across ranks.

Also the entry point of ``titanctl inspect-trace``: :func:`inspect_path` reads a file or a folder,
tells profiler traces from Flight Recorder dumps by their content, and analyzes each kind.

Rules (all times in microseconds, as in the trace):

- Events: complete events (``ph: X``) and matched begin/end pairs (``B``/``E``). Events without a
  numeric ``ts``/``dur`` are skipped and counted. Categories ``Trace`` (the profiler's own span),
  ``python_function`` (stack frames) and flow events are left out; ``ProfilerStep#N`` marks steps.
- Self time = an event's duration minus the durations of its direct children (events nested
  inside it on the same pid/tid), never below zero.
- Communication: an event whose name is a collective or point-to-point call. It starts with
  ``nccl``, ``gloo``, ``c10d``, ``_c10d_functional``/``c10d_functional``, ``record_param_comms`` or
  ``ProcessGroup``, or contains ``all_reduce``/``allreduce``, ``all_gather``/``allgather``,
  ``reduce_scatter``, ``all_to_all``/``alltoall``, ``broadcast`` or ``barrier`` (any case, with or
  without ``_``), or is a ``send``/``recv``/``isend``/``irecv`` call. ``aten::`` operators are never
  communication (``aten::broadcast_tensors`` is compute).
- Compute: every other operator (``cpu_op``, kernels, memcpy/memset, events without a category);
  annotations (``user_annotation``, ``gpu_user_annotation``) are neither, unless their name is a
  collective (gloo records its collectives as annotations on its own thread).
- Timeline: when a rank's trace has device events (``kernel``, ``gpu_memcpy``, ``gpu_memset``),
  compute and communication time come from the device events alone; otherwise from CPU events.
- Per thread, compute time = union(compute intervals) minus union(communication intervals), so an
  ``aten::copy_`` inside ``c10d::allreduce_`` is communication. Per rank, compute and
  communication are the unions over its threads; overlap = their intersection, exposed
  communication = communication minus overlap.
- Step time = the sum of ``ProfilerStep#N`` durations; without step markers, the trace's span.
- Straggler: a rank whose compute time or step time is more than ``threshold_pct`` (default 10%)
  above the median over ranks (needs two ranks or more).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pickle
import re
import statistics
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titanctl.errors import TraceError
from titanctl.observability import fr_analysis as fr
from titanctl.safe_io import check_pickle, open_regular, read_head

STRAGGLER_THRESHOLD_PCT = 10.0

_EXCLUDED_CATS = {"trace", "python_function", "ac2g", "flow", "cpu_instant_event"}
_ANNOTATION_CATS = {"user_annotation", "gpu_user_annotation"}
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_STEP = re.compile(r"^ProfilerStep#\d+$")
_COMM_PREFIX = re.compile(r"^(nccl|gloo|c10d|_c10d_functional|c10d_functional|record_param_comms|processgroup)", re.I)
_COMM_WORD = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier|(^|[^a-z])i?(send|recv)([^a-z]|$)", re.I
)


def is_communication(name: str) -> bool:
    """The communication rule of this module (see its docstring)."""
    if name.startswith("aten::"):
        return False
    return bool(_COMM_PREFIX.match(name) or _COMM_WORD.search(name))


# ------------------------------------------------------------------------------------- reading files


class _PlainUnpickler(pickle.Unpickler):
    """Plain containers and primitives only: any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise TraceError(f"refusing to unpickle {module}.{name}: only plain data is accepted")


DEFAULT_MAX_MIB = 1024  # a trace or dump larger than this once decompressed is refused
MAX_FILES = 100_000  # files looked at in a folder (a Flight Recorder dump per rank of a 16k-GPU job fits)


def _read_bounded(path: Path, max_mib: int) -> bytes | bytearray:
    """The file's bytes, gunzipped if it is gzip, refused beyond ``max_mib`` MiB: a gzip bomb of a few
    MB would otherwise grow without bound in memory. Decompresses chunk by chunk, never past the cap."""
    limit = max_mib * 2**20
    with open_regular(path, what="trace", error=TraceError) as f:  # a FIFO would block forever
        try:
            gzipped = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            if not gzipped:
                too_large = TraceError(f"{path} is larger than {max_mib} MiB: raise --max-size-mib to read it")
                if os.fstat(f.fileno()).st_size > limit:  # refused before a byte is read
                    raise too_large
                raw = f.read(limit + 1)
                if len(raw) > limit:  # it grew while being read
                    raise too_large
                return raw
        except OSError as e:
            raise TraceError(f"cannot read {path}: {e.strerror or e}") from None
        out = bytearray()
        try:
            with gzip.GzipFile(fileobj=f) as gz:
                while chunk := gz.read(min(1 << 20, limit + 1 - len(out))):
                    out += chunk
                    if len(out) > limit:
                        raise TraceError(
                            f"{path} decompresses to more than {max_mib} MiB: raise --max-size-mib to read it"
                        )
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: corrupt gzip file ({e})") from None
        return out


def read_document(path: Path, max_mib: int = DEFAULT_MAX_MIB) -> Any:
    """Decode a JSON file (optionally gzipped) or a plain-data pickle of at most ``max_mib`` MiB
    (decompressed). Raises TraceError, naming the file, when it is too big, corrupt or malformed."""
    raw = _read_bounded(Path(path), max_mib)
    head = raw[:64].lstrip()
    if raw[:1] == b"\x80":
        check_pickle(raw, what=str(path), error=TraceError)  # the C unpickler recurses on a deep key
        try:
            return _PlainUnpickler(io.BytesIO(raw)).load()
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None
        except Exception as e:
            raise TraceError(f"{path}: corrupt pickle ({type(e).__name__}: {e})") from None
    if head[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except RecursionError:
            raise TraceError(f"{path}: JSON nested too deeply to be a trace or a dump") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise TraceError(f"{path}: corrupt JSON ({e})") from None
    raise TraceError(f"{path}: neither JSON nor a pickle (is it a profiler trace or a Flight Recorder dump?)")


@contextlib.contextmanager
def _one_file(path: Path) -> Iterator[None]:
    """A value nested thousands of levels deep (str() of it recurses) is a malformed file, not a bug."""
    try:
        yield
    except RecursionError:
        raise TraceError(f"{path}: values nested too deeply to be a trace or a dump") from None


def looks_like_profiler_trace(doc: Any) -> bool:
    if isinstance(doc, dict):
        return isinstance(doc.get("traceEvents"), list)
    return isinstance(doc, list) and any(isinstance(e, dict) and "ph" in e for e in doc[:100])


def detect_kind(doc: Any) -> str | None:
    """"profiler", "flight_recorder" or None."""
    if looks_like_profiler_trace(doc):
        return "profiler"
    if fr.looks_like_dump(doc):
        return "flight_recorder"
    return None


# ------------------------------------------------------------------------------------ data structures


@dataclass
class Event:
    name: str
    cat: str
    pid: str
    tid: str
    ts: float
    dur: float

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class OpStat:
    name: str
    calls: int
    self_us: float
    total_us: float
    communication: bool


@dataclass
class RankProfile:
    rank: int
    path: str
    timeline: str  # "device" or "cpu"
    steps: int
    step_us: float  # sum of ProfilerStep#N durations, or the trace span without step markers
    compute_us: float
    comm_us: float
    overlap_us: float
    exposed_comm_us: float
    events: int
    skipped_events: int
    top_ops: list[OpStat]


@dataclass
class Straggler:
    rank: int
    metric: str  # "compute" or "step"
    value_us: float
    median_us: float
    pct_above_median: float


@dataclass
class ProfileReport:
    ranks: list[RankProfile]
    threshold_pct: float
    median_compute_us: float | None
    median_step_us: float | None
    stragglers: list[Straggler]
    summary: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------- events


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x and abs(x) != float("inf") else None


def _route(ev: Event, events: list[Event], steps: list[Event]) -> None:
    """Step markers go to ``steps`` (their GPU-side copies are dropped), everything else to ``events``."""
    if _STEP.match(ev.name):
        if ev.cat != "gpu_user_annotation":
            steps.append(ev)
    else:
        events.append(ev)


def parse_events(doc: Any) -> tuple[list[Event], list[Event], int]:
    """-> (events, step markers, skipped count). Tolerates missing or malformed fields."""
    raw = doc.get("traceEvents") if isinstance(doc, dict) else doc
    events: list[Event] = []
    steps: list[Event] = []
    skipped = 0
    open_: dict[tuple[str, str], list[tuple[str, str, float]]] = {}
    begin_end = []
    for e in raw or ():
        if not isinstance(e, dict):
            skipped += 1
            continue
        ph = e.get("ph")
        if ph not in ("X", "B", "E"):
            continue  # metadata, instants, counters, flows
        name = str(e.get("name", "?"))
        cat = str(e.get("cat") or "")
        if cat.lower() in _EXCLUDED_CATS:
            continue
        ts = _num(e.get("ts"))
        if ts is None:
            skipped += 1
            continue
        pid, tid = str(e.get("pid", "")), str(e.get("tid", ""))
        if ph == "X":
            dur = _num(e.get("dur"))
            if dur is None or dur < 0:
                skipped += 1
                continue
            _route(Event(name, cat, pid, tid, ts, dur), events, steps)
        else:
            begin_end.append((ts, name, cat, pid, tid, ph))
    # B/E pairs: per thread, an E closes the latest open B (same ts: file order decides)
    for ts, name, cat, pid, tid, ph in sorted(begin_end, key=lambda t: t[0]):
        stack = open_.setdefault((pid, tid), [])
        if ph == "B":
            stack.append((name, cat, ts))
        elif stack:
            bname, bcat, bts = stack.pop()
            _route(Event(bname, bcat, pid, tid, bts, ts - bts), events, steps)
        else:
            skipped += 1
    skipped += sum(len(s) for s in open_.values())  # a B that never ended
    return events, steps, skipped


def _self_times(events: list[Event]) -> list[float]:
    """Self time of each event: duration minus its direct children's on the same thread."""
    self_us = [e.dur for e in events]
    by_thread: dict[tuple[str, str], list[int]] = {}
    for i, e in enumerate(events):
        by_thread.setdefault((e.pid, e.tid), []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i].ts, -events[i].dur))
        stack: list[int] = []
        for i in idx:
            e = events[i]
            while stack and events[stack[-1]].end <= e.ts:
                stack.pop()
            if stack:
                parent = stack[-1]
                # a child that sticks out of its parent only counts inside it
                self_us[parent] -= min(e.end, events[parent].end) - e.ts
            stack.append(i)
    return [max(0.0, s) for s in self_us]


Intervals = list[tuple[float, float]]


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: Intervals, y: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Intervals, y: Intervals) -> Intervals:
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > start:
                out.append((start, y[k][0]))
            start = max(start, y[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def length(x: Intervals) -> float:
    return sum(b - a for a, b in x)


def analyze_rank(doc: Any, rank: int, path: str = "", top: int = 10) -> RankProfile:
    events, steps, skipped = parse_events(doc)
    self_us = _self_times(events)

    stats: dict[str, OpStat] = {}
    for e, s in zip(events, self_us):
        st = stats.get(e.name)
        if st is None:
            st = stats[e.name] = OpStat(e.name, 0, 0.0, 0.0, is_communication(e.name))
        st.calls += 1
        st.self_us += s
        st.total_us += e.dur
    top_ops = sorted(stats.values(), key=lambda o: (-o.self_us, o.name))[: max(0, top)]

    device = any(e.cat.lower() in _DEVICE_CATS for e in events)
    timeline = [e for e in events if not device or e.cat.lower() in _DEVICE_CATS | {"gpu_user_annotation"}]
    comm_by_thread: dict[tuple[str, str], list] = {}
    compute_by_thread: dict[tuple[str, str], list] = {}
    for e in timeline:
        key = (e.pid, e.tid)
        if is_communication(e.name):
            comm_by_thread.setdefault(key, []).append((e.ts, e.end))
        elif e.cat.lower() not in _ANNOTATION_CATS:
            compute_by_thread.setdefault(key, []).append((e.ts, e.end))
    comm_all: list = []
    compute_all: list = []
    for key in set(comm_by_thread) | set(compute_by_thread):
        comm = union(comm_by_thread.get(key, []))
        comm_all.extend(comm)
        compute_all.extend(subtract(union(compute_by_thread.get(key, [])), comm))
    comm_u, compute_u = union(comm_all), union(compute_all)
    overlap = length(intersect(comm_u, compute_u))

    if steps:
        # on GPU, the same step can be recorded on several threads: count each step name once
        longest: dict[str, float] = {}
        for s in steps:
            longest[s.name] = max(longest.get(s.name, 0.0), s.dur)
        n_steps, step_us = len(longest), sum(longest.values())
    else:
        n_steps = 0
        step_us = (max(e.end for e in events) - min(e.ts for e in events)) if events else 0.0
    return RankProfile(
        rank=rank, path=path, timeline="device" if device else "cpu", steps=n_steps, step_us=step_us,
        compute_us=length(compute_u), comm_us=length(comm_u), overlap_us=overlap,
        exposed_comm_us=length(comm_u) - overlap, events=len(events) + len(steps), skipped_events=skipped,
        top_ops=top_ops,
    )


def _trace_rank(doc: Any, path: Path) -> int | None:
    info = doc.get("distributedInfo") if isinstance(doc, dict) else None
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = re.search(r"rank[_-]?(\d+)", path.name, re.I) or re.search(r"(\d+)(?!.*\d)", path.name)
    return int(m.group(1)) if m else None


def analyze_profiles(
    docs: list[tuple[Path, Any]], top: int = 10, threshold_pct: float = STRAGGLER_THRESHOLD_PCT
) -> ProfileReport:
    """Analyze one trace per rank and compare the ranks."""
    if not docs:
        raise TraceError("no profiler traces to analyze")
    named: dict[int, Path] = {}
    for path, doc in docs:
        rank = _trace_rank(doc, path)
        if rank is not None and rank in named:
            raise TraceError(
                f"two profiler traces for rank {rank}: {named[rank]} and {path} "
                "(point inspect-trace at the traces of one step)"
            )
        if rank is not None:
            named[rank] = path
    ranks: dict[int, RankProfile] = {}
    free = (r for r in range(len(docs) + len(named) + 1) if r not in named)
    for path, doc in docs:
        rank = _trace_rank(doc, path)
        rank = next(free) if rank is None else rank  # no rank anywhere: number them in file order
        with _one_file(path):
            ranks[rank] = analyze_rank(doc, rank, str(path), top)
    profiles = [ranks[r] for r in sorted(ranks)]

    stragglers: list[Straggler] = []
    med_compute = med_step = None
    if len(profiles) >= 2:
        med_compute = statistics.median(p.compute_us for p in profiles)
        med_step = statistics.median(p.step_us for p in profiles)
        for p in profiles:
            for metric, value, med in (("compute", p.compute_us, med_compute), ("step", p.step_us, med_step)):
                if med > 0 and value > med * (1 + threshold_pct / 100):
                    stragglers.append(Straggler(p.rank, metric, value, med, 100 * (value / med - 1)))
    summary = []
    for s in stragglers:
        summary.append(
            f"rank {s.rank} is a straggler: {s.metric} time {format_us(s.value_us)} is "
            f"{s.pct_above_median:.1f}% above the median {format_us(s.median_us)} (threshold {threshold_pct:g}%)"
        )
    if len(profiles) >= 2 and not stragglers:
        summary.append(f"no straggler: every rank is within {threshold_pct:g}% of the median compute and step time")
    return ProfileReport(
        ranks=profiles, threshold_pct=threshold_pct, median_compute_us=med_compute, median_step_us=med_step,
        stragglers=stragglers, summary=summary,
    )


def format_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3f} s"
    if us >= 1e3:
        return f"{us / 1e3:.3f} ms"
    return f"{us:.1f} µs"


# ------------------------------------------------------------------------------------ inspect a path


@dataclass
class InspectResult:
    path: str
    profile: ProfileReport | None
    flight_recorder: fr.FlightRecorderReport | None
    skipped: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "profile": self.profile.to_dict() if self.profile else None,
            "flight_recorder": self.flight_recorder.to_dict() if self.flight_recorder else None,
            "skipped": self.skipped,
        }


def _candidate_files(folder: Path) -> list[Path]:
    """The regular files under ``folder`` (hidden ones and hidden folders left out), sorted; at most
    MAX_FILES, counted while walking, so a huge tree is refused before it is listed whole."""
    files = []
    for root, dirs, names in os.walk(folder):  # symlinked folders are not entered
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(root, name)
            if not name.startswith(".") and path.is_file():
                files.append(path)
                if len(files) > MAX_FILES:
                    raise TraceError(
                        f"{folder} holds more than {MAX_FILES:,} files: point inspect-trace at the traces or "
                        "dumps of one step"
                    )
    return sorted(files)


def _sniff(path: Path) -> bool:
    """Could this file be a trace or a dump (JSON, gzip or pickle)? Cheap: reads a few bytes."""
    try:
        head = read_head(path, 64, what="trace", error=TraceError)
    except TraceError:
        return False
    return head[:2] == b"\x1f\x8b" or head[:1] == b"\x80" or head.lstrip()[:1] in (b"{", b"[")


def inspect_path(
    path: Path, top: int = 10, threshold_pct: float = STRAGGLER_THRESHOLD_PCT, max_mib: int = DEFAULT_MAX_MIB
) -> InspectResult:
    """Read a trace/dump file or a folder of them (each at most ``max_mib`` MiB decompressed) and
    analyze what was found."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path} does not exist")
    if top < 0:
        raise TraceError(f"--top must be >= 0, got {top}")
    skipped: list[str] = []
    profiles: list[tuple[Path, Any]] = []
    dumps: list[fr.RankDump] = []
    if path.is_dir():
        candidates = _candidate_files(path)
        files = [p for p in candidates if _sniff(p)]
        sniffed = set(files)  # a list lookup here made 3x10^4 files take hours
        skipped.extend(str(p) for p in candidates if p not in sniffed)
    else:
        files = [path]
    for p in files:
        doc = read_document(p, max_mib)
        kind = detect_kind(doc)
        if kind == "profiler":
            profiles.append((p, doc))
        elif kind == "flight_recorder":
            with _one_file(p):
                dumps.append(fr.parse_dump(doc, p))
        elif path.is_dir():
            skipped.append(str(p))
        else:
            raise TraceError(f"{p}: not a torch.profiler trace nor a Flight Recorder dump")
    if not profiles and not dumps:
        raise TraceError(f"{path}: no torch.profiler traces or Flight Recorder dumps found")
    return InspectResult(
        path=str(path),
        profile=analyze_profiles(profiles, top, threshold_pct) if profiles else None,
        flight_recorder=fr.analyze(dumps) if dumps else None,
        skipped=skipped,
    )
