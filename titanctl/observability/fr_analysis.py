"""Flight Recorder dumps of all ranks: which rank is stuck at which collective.

Every process group numbers its collectives 1, 2, 3, ... on every rank (``collective_seq_id``);
a healthy job has, for each number, the same op with the same input sizes on every member rank.
We line the ranks' records up number by number, per process group, and name the FIRST number
where they disagree:

- ``missing``: some ranks recorded collective #N, others never did (their records end before N):
  those others are the culprits, the ranks whose last record is #N are waiting in it.
- ``op`` / ``sizes`` / ``dtypes``: every rank reached #N but not all with the same op, input sizes
  or dtypes; the ranks that differ from the largest group are the culprits.

Comparison starts at the first number that every rank still holds (the buffer is a ring).
Point-to-point entries (``is_p2p``) have no collective number and are left out.
gloo never marks entries completed, so "waiting in #N" means "#N is the last thing it recorded";
with NCCL, entries that reached ``completed`` are reported as such.

Input: the dicts of ``torch._C._distributed_c10d._dump_fr_trace_json()`` (as written by
``titanctl.parallel.runtime.hang_watchdog.dump``) or torch's own pickled dumps, decoded safely by the caller.
"""

from __future__ import annotations

import ast
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titanctl.errors import TraceError


def looks_like_dump(doc: Any) -> bool:
    """True for a Flight Recorder dump (JSON or unpickled)."""
    return isinstance(doc, dict) and (
        "entries" in doc or ("pg_config" in doc and ("pg_status" in doc or "version" in doc))
    )


@dataclass(frozen=True)
class Collective:
    """One recorded collective of one rank."""

    seq: int
    op: str  # profiling name without the backend prefix: "all_reduce"
    profiling_name: str  # as recorded: "gloo:all_reduce", "nccl:all_reduce"
    input_sizes: tuple = ()
    input_dtypes: tuple = ()
    state: str = ""

    def signature(self) -> tuple:
        return (self.op, self.input_sizes, self.input_dtypes)

    def describe(self, with_seq: bool = True) -> str:
        text = f"{self.op} {format_sizes(self.input_sizes)}".rstrip()
        return f"#{self.seq} {text}" if with_seq else text


@dataclass
class RankDump:
    rank: int
    path: str
    groups: dict[str, dict[str, Any]]  # group name -> {"desc": str, "ranks": [int] or None}
    collectives: dict[str, dict[int, list[Collective]]]  # group name -> seq -> entries
    p2p_entries: int = 0
    replica_group: int | None = None  # torchft: the replica group whose rank wrote it


@dataclass
class Mismatch:
    kind: str  # "missing", "op", "sizes", "dtypes"
    seq: int
    expected: str  # what the reference ranks entered: "all_reduce [1024]"
    culprits: list[int]
    reference_ranks: list[int]
    found: dict[int, str]  # culprit rank -> what it entered at seq ("" when it never entered)
    waiting: list[int]  # ranks whose last record is seq
    ambiguous: bool = False  # no majority: the reference group was picked by lowest rank


@dataclass
class RankState:
    rank: int
    last: str  # "#6 broadcast [1024]" or "" when it recorded nothing in this group
    last_seq: int
    state: str
    note: str


@dataclass
class GroupReport:
    name: str
    desc: str
    ranks: list[int]
    ranks_known: bool  # from the dump's group layout, not guessed from who recorded something
    first_seq: int  # first collective every rank still holds
    last_seq: int
    mismatch: Mismatch | None
    ranks_state: list[RankState]
    missing_dumps: list[int]
    message: str


@dataclass
class FlightRecorderReport:
    dumps: list[str]
    ranks: list[int]
    groups: list[GroupReport]
    culprits: list[int]
    summary: list[str]
    notes: list[str] = field(default_factory=list)
    replica_groups: list[int] = field(default_factory=list)  # torchft: the replica groups the dumps came from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------- formatting


def format_sizes(sizes: Any) -> str:
    """``[[1024]]`` -> ``[1024]``; ``[[4, 3], [2]]`` -> ``[4, 3] [2]``."""
    parts = []
    for s in sizes or ():
        if isinstance(s, (list, tuple)):
            parts.append("[" + ", ".join(str(d) for d in s) + "]")
        else:
            parts.append(str(s))
    return " ".join(parts)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; ``[0, 1, 3]`` -> ``0,1,3``; runs of three or more collapse."""
    ranks = sorted(set(ranks))
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ranks[i]}-{ranks[j]}")
        else:
            out.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return ",".join(out)


def _who(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)


# ------------------------------------------------------------------------------------------- parsing


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


_MAX_DEPTH = 16  # input sizes are lists of shapes: 2 levels; deeper is not a dump torch wrote


def _freeze(value: Any, depth: int = 0) -> Any:
    if isinstance(value, (list, tuple)):
        if depth >= _MAX_DEPTH:
            raise ValueError(f"a value nested more than {_MAX_DEPTH} levels deep")
        return tuple(_freeze(v, depth + 1) for v in value)
    return value


def _parse_ranks(value: Any) -> list[int] | None:
    """pg_config ranks come as a list or as a string like "[0, 1]" (or "all")."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    if isinstance(value, (list, tuple)):
        ranks = [_as_int(r) for r in value]
        if ranks and all(r is not None for r in ranks):
            return sorted(set(ranks))  # type: ignore[arg-type]
    return None


def _rank_of(doc: dict, path: Path) -> int | None:
    meta = doc.get("titanctl")
    for value in ((meta or {}).get("rank") if isinstance(meta, dict) else None, doc.get("rank")):
        if _as_int(value) is not None:
            return _as_int(value)
    numbers = re.findall(r"\d+", path.name)
    return int(numbers[-1]) if numbers else None


def parse_dump(doc: dict, path: Path) -> RankDump:
    """One rank's dump -> its collectives per process group. Missing fields are tolerated."""
    rank = _rank_of(doc, path)
    if rank is None:
        raise TraceError(f"{path}: cannot tell which rank this Flight Recorder dump is from (name it rank<N>.json)")
    groups: dict[str, dict[str, Any]] = {}
    pg_config = doc.get("pg_config")
    if isinstance(pg_config, dict):
        for key, cfg in pg_config.items():
            if not isinstance(cfg, dict) or not str(key):
                continue
            name = str(cfg.get("name") or key)
            desc = str(cfg.get("desc") or "")
            groups[name] = {"desc": "" if desc == "undefined" else desc, "ranks": _parse_ranks(cfg.get("ranks"))}
    entries = doc.get("entries") or []
    if not isinstance(entries, list):
        raise TraceError(f"{path}: 'entries' of a Flight Recorder dump must be a list")
    collectives: dict[str, dict[int, list[Collective]]] = {}
    p2p = 0
    for e in entries:
        if not isinstance(e, dict):
            continue
        if e.get("is_p2p"):
            p2p += 1
            continue
        seq = _as_int(e.get("collective_seq_id"))
        if seq is None or seq <= 0:
            continue
        pg = e.get("process_group")
        if isinstance(pg, (list, tuple)) and pg:
            name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
        else:
            name, desc = str(e.get("pg_id", "?")), ""
        desc = "" if desc == "undefined" else desc  # groups created without group_desc
        info = groups.setdefault(name, {"desc": desc, "ranks": None})
        if not info["desc"] and desc:
            info["desc"] = desc
        profiling_name = str(e.get("profiling_name") or "?")
        try:
            sizes, dtypes = _freeze(e.get("input_sizes") or ()), _freeze(e.get("input_dtypes") or ())
        except ValueError as bad:
            raise TraceError(f"{path}: entry {seq} of the Flight Recorder dump has {bad}") from None
        c = Collective(
            seq=seq,
            op=profiling_name.split(":", 1)[-1],
            profiling_name=profiling_name,
            input_sizes=sizes,
            input_dtypes=dtypes,
            state=str(e.get("state") or ""),
        )
        collectives.setdefault(name, {}).setdefault(seq, []).append(c)
    meta = doc.get("titanctl")
    replica_group = _as_int(meta.get("replica_group")) if isinstance(meta, dict) else None
    return RankDump(rank=rank, path=str(path), groups=groups, collectives=collectives, p2p_entries=p2p,
                    replica_group=replica_group)


# ------------------------------------------------------------------------------------------ analysis


def _describe_at(entries: list[Collective], with_seq: bool = False) -> str:
    text = " + ".join(c.describe(with_seq=False) for c in entries)
    return f"#{entries[0].seq} {text}" if with_seq else text


def _signature(entries: list[Collective]) -> tuple:
    return tuple(c.signature() for c in entries)


def _diff_kind(a: list[Collective], b: list[Collective]) -> str:
    if [c.op for c in a] != [c.op for c in b]:
        return "op"
    if [c.input_sizes for c in a] != [c.input_sizes for c in b]:
        return "sizes"
    return "dtypes"


def _analyze_group(name: str, dumps: dict[int, RankDump]) -> GroupReport | None:
    desc, declared = "", None
    for d in dumps.values():
        info = d.groups.get(name)
        if info:
            desc = desc or info["desc"]
            declared = declared or info["ranks"]
    recorded = sorted(r for r, d in dumps.items() if d.collectives.get(name))
    if not recorded:
        return None
    ranks = declared or recorded
    members = [r for r in ranks if r in dumps]
    missing_dumps = [r for r in ranks if r not in dumps]
    seqs = {r: dumps[r].collectives.get(name, {}) for r in members}
    last = {r: max(s) if s else 0 for r, s in seqs.items()}
    first_seq = max((min(s) for s in seqs.values() if s), default=1)
    last_seq = max(last.values(), default=0)
    tracks_completion = any(c.state == "completed" for s in seqs.values() for es in s.values() for c in es)

    mismatch: Mismatch | None = None
    for seq in range(first_seq, last_seq + 1):
        present = {r: seqs[r][seq] for r in members if seq in seqs[r]}
        absent = [r for r in members if seq not in seqs[r]]
        if not present:  # a number nobody recorded (not a collective of this group): skip it
            continue
        by_sig: dict[tuple, list[int]] = {}
        for r, entries in present.items():
            by_sig.setdefault(_signature(entries), []).append(r)
        # the reference: what most ranks entered (ties: the group holding the lowest rank)
        ref_sig, ref_ranks = max(by_sig.items(), key=lambda kv: (len(kv[1]), -min(kv[1])))
        ref_entries = present[ref_ranks[0]]
        ambiguous = sum(1 for rs in by_sig.values() if len(rs) == len(ref_ranks)) > 1
        waiting = [r for r in present if last[r] == seq]
        if absent:
            mismatch = Mismatch(
                kind="missing", seq=seq, expected=_describe_at(ref_entries), culprits=absent,
                reference_ranks=sorted(present), found={r: "" for r in absent}, waiting=waiting,
            )
            break
        if len(by_sig) > 1:
            culprits = sorted(r for r in present if r not in ref_ranks)
            mismatch = Mismatch(
                kind=_diff_kind(ref_entries, present[culprits[0]]), seq=seq, expected=_describe_at(ref_entries),
                culprits=culprits, reference_ranks=sorted(ref_ranks),
                found={r: _describe_at(present[r]) for r in culprits}, waiting=waiting, ambiguous=ambiguous,
            )
            break

    states = []
    for r in members:
        s = seqs[r]
        last_entries = s.get(last[r], [])
        state = last_entries[-1].state if last_entries else ""
        if not last_entries:
            note = "recorded nothing in this group"
        elif mismatch and r in mismatch.culprits and mismatch.kind == "missing":
            note = f"never entered #{mismatch.seq}"
        elif mismatch and r in mismatch.culprits:
            what = {"op": "a different op", "sizes": "different sizes", "dtypes": "different dtypes"}[mismatch.kind]
            note = f"entered #{mismatch.seq} with {what}"
        elif tracks_completion and state == "completed":
            note = "all recorded collectives completed"
        elif mismatch and last[r] == mismatch.seq:
            note = f"waiting in #{mismatch.seq}"
        elif mismatch and last[r] > mismatch.seq:
            note = f"went past #{mismatch.seq}"
        else:
            note = "last recorded"
        states.append(
            RankState(rank=r, last=_describe_at(last_entries, with_seq=True) if last_entries else "",
                      last_seq=last[r], state=state, note=note)
        )

    label = name + (f" ({desc}, ranks {format_ranks(ranks)})" if desc else f" (ranks {format_ranks(ranks)})")
    message = f"process group {label}: " + _verdict(mismatch, states, first_seq, last_seq, tracks_completion)
    return GroupReport(
        name=name, desc=desc, ranks=list(ranks), ranks_known=declared is not None, first_seq=first_seq,
        last_seq=last_seq, mismatch=mismatch, ranks_state=states, missing_dumps=missing_dumps, message=message,
    )


def _verdict(m: Mismatch | None, states: list[RankState], first: int, last: int, tracks: bool) -> str:
    by_rank = {s.rank: s for s in states}
    if m is None:
        text = f"all ranks agree on collectives #{first}..#{last}"
        if tracks:
            open_ = [s.rank for s in states if s.state and s.state != "completed"]
            if open_:
                text += f"; {_who(open_)} still in their last collective"
        return text
    if m.kind == "missing":
        lasts = {by_rank[r].last or "none" for r in m.culprits}
        if len(m.culprits) == 1:
            tail = f"its last collective is {by_rank[m.culprits[0]].last or 'none'}"
        elif len(lasts) == 1:
            tail = f"their last collective is {lasts.pop()}"
        else:
            tail = "last collectives: " + ", ".join(f"rank {r} {by_rank[r].last or 'none'}" for r in m.culprits)
        text = f"collective #{m.seq} {m.expected} — {_who(m.culprits)} never entered it ({tail})"
    else:
        what = {"op": "a different op", "sizes": "different input sizes", "dtypes": "different dtypes"}[m.kind]
        found = "; ".join(f"rank {r}: {m.found[r]}" for r in m.culprits)
        if m.ambiguous:
            text = (f"collective #{m.seq}: ranks disagree ({what}) — {_who(m.reference_ranks)} entered {m.expected}; "
                    f"{found}")
        else:
            text = (f"collective #{m.seq} {m.expected} — {_who(m.culprits)} entered it with {what} ({found})")
    if m.waiting:
        verb = "is" if len(m.waiting) == 1 else "are"
        text += f"; {_who(m.waiting)} {verb} waiting in #{m.seq}"
    return text


def analyze(dumps: list[RankDump]) -> FlightRecorderReport:
    """Line up every process group's collectives across the ranks' dumps."""
    if not dumps:
        raise TraceError("no Flight Recorder dumps to analyze")
    by_rank: dict[int, RankDump] = {}
    if len({d.replica_group for d in dumps}) > 1:
        raise TraceError("these dumps come from several torchft replica groups (each its own world, ranks from 0): "
                         "inspect one group's flight_recorder folder at a time")
    for d in dumps:
        if d.rank in by_rank:
            raise TraceError(f"two Flight Recorder dumps claim rank {d.rank}: {by_rank[d.rank].path} and {d.path}")
        by_rank[d.rank] = d
    names = sorted({n for d in dumps for n in d.collectives}, key=lambda n: (_as_int(n) is None, _as_int(n) or 0, n))
    groups = [g for g in (_analyze_group(n, by_rank) for n in names) if g is not None]
    culprits = sorted({r for g in groups if g.mismatch for r in g.mismatch.culprits})
    notes = []
    missing = sorted({r for g in groups for r in g.missing_dumps})
    if missing:
        notes.append(f"no dump from {_who(missing)}: left out of the comparison (a rank that never dumped "
                     "may be the one that crashed or hangs)")
    guessed = [g.name for g in groups if not g.ranks_known]
    if guessed:
        notes.append(f"group layout missing from the dumps of group(s) {', '.join(guessed)}: members guessed from "
                     "the ranks that recorded collectives in them")
    p2p = sum(d.p2p_entries for d in dumps)
    if p2p:
        notes.append(f"{p2p} point-to-point entries are not compared")
    trimmed = [g.name for g in groups if g.first_seq > 1]
    if trimmed:
        notes.append(f"older collectives dropped from the ring buffer in group(s) {', '.join(trimmed)}: compared "
                     "from the first collective every rank still holds")
    # mismatching groups first: they are the answer
    groups.sort(key=lambda g: g.mismatch is None)
    if not groups:
        summary = ["the dumps hold no collectives: was the Flight Recorder off (TORCH_FR_BUFFER_SIZE=0, or set "
                   "after the process group was created)?"]
    elif not any(g.mismatch for g in groups):
        summary = ["no mismatch: in every process group all ranks recorded the same collectives"]
    else:
        summary = [g.message for g in groups if g.mismatch]
    replica_groups = sorted({d.replica_group for d in dumps if d.replica_group is not None})
    if replica_groups and len(replica_groups) == 1 and any(g.mismatch for g in groups):
        # Under torchft each replica group is its own world: the stall is inside this group.
        summary = [f"replica group {replica_groups[0]}: {line}" for line in summary]
    return FlightRecorderReport(
        dumps=[d.path for d in sorted(dumps, key=lambda d: d.rank)], ranks=sorted(by_rank), groups=groups,
        culprits=culprits, summary=summary, notes=notes, replica_groups=replica_groups,
    )
