"""Hostile and damaged checkpoints: no code runs from any of them, corruption is caught by checksums,
files a checkpoint names stay inside it, declared sizes are checked before anything is allocated,
file-system faults are one line. Every crafted file is made here, from one shared trained run.

Payloads are pickled objects whose ``__reduce__`` would create a marker file; each case asserts the
marker is absent, one red line on stderr, exit code 2, and not a byte changed in the checkpoint.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import OFFLINE_ENV, TRUSTED_RUN
from titanctl.checkpoint.trust.metadata import fields_digest

STEP = Path("checkpoint") / "step-2"


# ----------------------------------------------------------------------------- crafting


class Payload:
    """Unpickling this runs ``touch MARKER`` (if anything lets it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def clone(run: Path, dst: Path) -> Path:
    """A copy of a dump folder whose DCP data files are hard links (cheap). Nothing writes into an
    existing data file (crafting goes through rewrite(), which breaks the link first)."""

    def link_data(src: str, target: str) -> None:
        (os.link if src.endswith(".distcp") else shutil.copy2)(src, target)

    shutil.copytree(run, dst, copy_function=link_data)
    return dst


def rewrite(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def rerecord_checksums(step: Path) -> None:
    """What a careful attacker does: make titanctl.json's checksums match the crafted files."""
    meta = json.loads((step / "titanctl.json").read_text())
    for name in meta["checksums"]["files"]:
        meta["checksums"]["files"][name] = hashlib.sha256((step / name).read_bytes()).hexdigest()
    rewrite(step / "titanctl.json", json.dumps(meta).encode())


def read_index(step: Path):
    with open(step / ".metadata", "rb") as f:
        return pickle.load(f)  # our own fixture's file: trusted here


def write_index(step: Path, index) -> None:
    rewrite(step / ".metadata", pickle.dumps(index))


def poison_metadata(step: Path, marker: Path) -> None:
    index = read_index(step)
    index.planner_data = {"innocent": Payload(marker)}
    write_index(step, index)
    rerecord_checksums(step)


def poison_item(step: Path, marker: Path, fqn: str = "train_state.step") -> None:
    """Replace the bytes of a non-tensor item with a torch.save'd payload (appended to the data file)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = read_index(step)
    key = MetadataIndex(fqn)
    info = index.storage_data[key]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    data = step / info.relative_path
    old = data.read_bytes()
    rewrite(data, old + buffer.getvalue())
    info.offset, info.length = len(old), len(buffer.getvalue())
    write_index(step, index)
    rerecord_checksums(step)


def flip_4k(step: Path) -> Path:
    """Invert 4 KB inside the data of a tensor (same file size, checksums left as they were)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = read_index(step)
    info = index.storage_data[MetadataIndex("tok_embeddings.weight", (0, 0))]
    data = step / info.relative_path
    raw = bytearray(data.read_bytes())
    start = info.offset + info.length // 2
    raw[start : start + 4096] = bytes(b ^ 0xFF for b in raw[start : start + 4096])
    rewrite(data, bytes(raw))
    return data


# ----------------------------------------------------------------------------- running


def _without_dac_override() -> None:
    """As root, drop the capabilities that bypass file permissions (so chmod 000 means something)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone for the exec'd program
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# Runs `python -m titanctl ARGS...` and, at exit, writes its peak resident memory (VmHWM, KiB) to
# argv[1]. VmHWM belongs to the program after exec; getrusage/wait4 would also count the pytest
# process the child was forked from.
_MEASURED = """
import atexit, runpy, sys
def report(path=sys.argv[1]):
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(peak)
atexit.register(report)
sys.argv = ["titanctl", *sys.argv[2:]]
runpy.run_module("titanctl", run_name="__main__", alter_sys=True)
"""


def run(args: list, *, unprivileged: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """The titanctl binary: (the finished process, its peak resident memory in MiB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".hwm") as peak:
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURED, peak.name, *map(str, args)], capture_output=True, text=True,
            env={**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}, timeout=300,
            preexec_fn=_without_dac_override if unprivileged else None,
        )
        return proc, int(peak.read() or 0) / 1024


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def infer_args(checkpoint: Path) -> list:
    return ["infer-tp", "--checkpoint", checkpoint, "--prompt", "The", "--max-new-tokens", "2", "--temperature", "0"]


# ----------------------------------------------------------------------------- cases through the binary

PAYLOADS = {
    "metadata": (poison_metadata, r"step-2/\.metadata: refusing to unpickle posix\.system \(not a DCP metadata class\)"),
    "item": (poison_item, r"step-2/__0_0\.distcp \(item 'train_state\.step'\): refusing to unpickle posix\.system "
                          r"\(not plain data\)"),
}
PATHS = {
    "convert": lambda case, step: ["convert", step, case / "out", "--to", "hf"],
    "infer_tp": lambda case, step: infer_args(step),
    "initial_load_path": lambda case, step: ["train", *TRUSTED_RUN, "--job.dump_folder", case / "fresh",
                                             "--checkpoint.initial_load_path", step],
    "resume": lambda case, step: ["train", *TRUSTED_RUN, "--training.steps", "3", "--job.dump_folder", case / "run"],
}
PAYLOAD_CASES = [(kind, path) for kind in PAYLOADS for path in PATHS]
FLIP_MESSAGE = r"step-2/__0_0\.distcp does not match the sha256 checksum recorded when the checkpoint was saved"
BIG = 10**7  # layers a crafted config declares
HUGE_DIM = 10**9


def bomb_titanctl_json(step: Path, **changes) -> None:
    """A careful attacker's edit: the model arguments changed, and the checksum of the fields re-recorded."""
    meta = json.loads((step / "titanctl.json").read_text())
    meta["model_args"].update(changes)
    meta["checksums"]["fields"] = fields_digest(meta)
    rewrite(step / "titanctl.json", json.dumps(meta).encode())


def bomb_json(path: Path, **changes) -> None:
    rewrite(path, json.dumps({**json.loads(path.read_text()), **changes}).encode())


@pytest.fixture(scope="module")
def formats(foreign_formats) -> dict[str, Path]:
    """The run's step-2 weights as a Hugging Face folder and as a Meta folder (tests/conftest.py)."""
    return foreign_formats


def cli(args: list, capsys) -> subprocess.CompletedProcess:
    """The titanctl CLI in this process (the same main() as the binary, without a process start)."""
    from titanctl.cli.app import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, exit_.value.code, captured.out, captured.err)


# ----------------------------------------------------------------------------- code execution


@pytest.mark.parametrize("kind, path", PAYLOAD_CASES, ids=[f"{k}-{p}" for k, p in PAYLOAD_CASES])
def test_payload_never_runs(trained_run, tmp_path, capsys, kind, path):
    step = clone(trained_run, tmp_path / "run") / STEP
    poison, message = PAYLOADS[kind]
    poison(step, tmp_path / "marker")
    before = tree_hash(tmp_path / "run" / "checkpoint")
    line = error_line(cli(PATHS[path](tmp_path, step), capsys))
    assert re.search(message, line), line
    assert not (tmp_path / "marker").exists(), "the payload ran"
    assert tree_hash(tmp_path / "run" / "checkpoint") == before, "a refused checkpoint changed on disk"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_the_payloads_are_real(trained_run, tmp_path):
    """What the cases above guard against: torch's own readers run both payloads."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    step = clone(trained_run, tmp_path / "a") / STEP
    poison_metadata(step, tmp_path / "marker-a")
    FileSystemReader(str(step)).read_metadata()  # DCP's reader: a bare pickle.load
    assert (tmp_path / "marker-a").exists()
    step = clone(trained_run, tmp_path / "b") / STEP
    poison_item(step, tmp_path / "marker-b")
    info = read_index(step).storage_data[MetadataIndex("train_state.step")]
    with open(step / info.relative_path, "rb") as f:
        f.seek(info.offset)
        torch.load(io.BytesIO(f.read(info.length)), weights_only=False)  # what DCP's planner does
    assert (tmp_path / "marker-b").exists()


# ----------------------------------------------------------------------------- silent corruption


@pytest.mark.parametrize("path", ["convert", "infer_tp"])
def test_bit_flip_is_refused_naming_the_file(trained_run, tmp_path, capsys, path):
    step = clone(trained_run, tmp_path / "run") / STEP
    flip_4k(step)
    before = tree_hash(step)
    assert re.search(FLIP_MESSAGE, error_line(cli(PATHS[path](tmp_path, step), capsys)))
    assert tree_hash(step) == before


def resume_falls_back(run_dir: Path, message: str, capsys) -> subprocess.CompletedProcess:
    """Resume the run in `run_dir`, whose step-2 is damaged: the note names `message` and step-1."""
    proc = cli(["train", *TRUSTED_RUN, "--job.dump_folder", run_dir], capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    note = next(line for line in proc.stdout.splitlines() if "note:" in line)
    assert re.search(message, note), note
    assert note.rstrip().endswith(f"falling back to {run_dir / 'checkpoint' / 'step-1'}"), note
    assert "training continues at step 1" in proc.stdout
    return proc


@pytest.mark.slow
def test_bit_flip_on_resume_falls_back_to_the_previous_step(trained_run, tmp_path, capsys):
    run_dir = clone(trained_run, tmp_path / "run")
    flip_4k(run_dir / STEP)
    resume_falls_back(run_dir, FLIP_MESSAGE, capsys)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["loss"] == reference[-1]["loss"], "the redone step 2 differs"
    assert json.loads((run_dir / STEP / "titanctl.json").read_text())["checksums"], "step-2 written anew"


# ----------------------------------------------------------------------------- through the binary


def prepare_processes(trained_run: Path, formats: dict[str, Path], root: Path) -> dict[str, dict]:
    """Cases that need a process of their own: {case: {args, watch, unprivileged, chmod}}."""
    cases: dict[str, dict] = {}
    # Resource bombs (their peak memory is measured): sizes declared by the checkpoint's own JSON.
    case = root / "bomb-meta-layers"
    shutil.copytree(formats["meta"], case / "meta")
    bomb_json(case / "meta" / "params.json", n_layers=BIG)
    cases["bomb-meta-layers"] = {"args": ["convert", case / "meta", case / "out"], "watch": case / "meta"}
    case = root / "bomb-hf-layers"
    shutil.copytree(formats["hf"], case / "hf")
    bomb_json(case / "hf" / "config.json", num_hidden_layers=BIG)
    cases["bomb-hf-layers"] = {"args": ["convert", case / "hf", case / "out"], "watch": case / "hf"}
    case = root / "bomb-dcp-layers"
    step = clone(trained_run, case / "run") / STEP
    bomb_titanctl_json(step, n_layers=BIG)
    cases["bomb-dcp-layers"] = {"args": infer_args(step), "watch": case / "run"}
    case = root / "bomb-dcp-dim"
    step = clone(trained_run, case / "run") / STEP
    bomb_titanctl_json(step, dim=HUGE_DIM)
    cases["bomb-dcp-dim"] = {"args": infer_args(step), "watch": case / "run"}
    # A step folder that may not be read (as root, the run drops the capabilities that bypass that).
    for path in ("resume", "convert"):
        case = root / f"unreadable-{path}"
        step = clone(trained_run, case / "run") / STEP
        cases[f"unreadable-{path}"] = {"args": PATHS[path](case, step), "unprivileged": True, "chmod": step}
    return cases


@pytest.fixture(scope="module")
def outcomes(trained_run, formats, tmp_path_factory):
    """The process cases, a few at a time: {case: (process, peak MiB, hash before, hash after, case folder)}."""
    root = tmp_path_factory.mktemp("trust")
    cases = prepare_processes(trained_run, formats, root)
    before = {name: tree_hash(c["watch"]) for name, c in cases.items() if "watch" in c}
    for c in cases.values():
        if "chmod" in c:
            c["chmod"].chmod(0)

    def go(item):
        name, c = item
        return name, run(c["args"], unprivileged=c.get("unprivileged", False))

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = dict(pool.map(go, cases.items()))
    finally:
        for c in cases.values():
            if "chmod" in c:
                c["chmod"].chmod(0o755)
    after = {name: tree_hash(c["watch"]) for name, c in cases.items() if "watch" in c}
    return {name: (*results[name], before.get(name), after.get(name), root / name) for name in cases}


@pytest.mark.parametrize(
    "name, message",
    [
        ("bomb-meta-layers", r"params\.json declares n_layers 10000000, but the checkpoint holds tensors of 2 layer"),
        ("bomb-hf-layers", r"config\.json declares n_layers 10000000, but the checkpoint holds tensors of 2 layer"),
        ("bomb-dcp-layers", r"titanctl\.json declares n_layers 10000000, but the checkpoint holds tensors of 2 layer"),
        ("bomb-dcp-dim", r"titanctl\.json declares dim 1000000000, but the checkpoint's final norm has shape \(256,\)"),
    ],
)
def test_resource_bomb_is_refused_before_allocating(outcomes, name, message):
    proc, peak_mib, before, after, _ = outcomes[name]
    assert re.search(message, error_line(proc))
    assert 0 < peak_mib < 1024, f"peak RSS {peak_mib:.0f} MiB: something was sized by the declared model"
    assert before == after


@pytest.mark.parametrize("path", ["resume", "convert"])
def test_unreadable_step_folder_is_one_line(outcomes, path):
    proc, *_ = outcomes[f"unreadable-{path}"]
    assert re.search(r"cannot read checkpoint folder .*step-2: permission denied", error_line(proc))


# ----------------------------------------------------------------------------- paths outside the source


def escape_hf_index(folder: Path, target: str) -> None:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():  # one model.safetensors: the index save_pretrained writes for shards
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            index.write_text(json.dumps({"weight_map": dict.fromkeys(f.keys(), "model.safetensors")}))
    data = json.loads(index.read_text())
    first = sorted(data["weight_map"])[0]
    data["weight_map"][first] = target
    rewrite(index, json.dumps(data).encode())


def link_out(folder: Path, name: str, outside: Path) -> None:
    """Replace folder/name by a link to a copy of it outside the folder (same bytes: checksums still match)."""
    shutil.copy(folder / name, outside)
    (folder / name).unlink()
    (folder / name).symlink_to(outside)


def escape_dcp_storage(step: Path, target: str) -> None:
    index = read_index(step)
    for info in index.storage_data.values():
        info.relative_path = target
    write_index(step, index)
    rerecord_checksums(step)


TRAVERSALS = {
    "hf-absolute": ("hf", lambda f, t: escape_hf_index(f, "/etc/passwd"), r"names '/etc/passwd', a path outside"),
    "hf-dotdot": ("hf", lambda f, t: escape_hf_index(f, "../../../etc/passwd"),
                  r"names '\.\./\.\./\.\./etc/passwd', a path outside"),
    "hf-symlink": ("hf", lambda f, t: link_out(f, sorted(p.name for p in f.glob("*.safetensors"))[0], t / "elsewhere"),
                   r"names 'model-00001-of-\d+\.safetensors', a link to .*/elsewhere outside"),  # the session's shards
    "dcp-dotdot": ("dcp", lambda f, t: escape_dcp_storage(f, "../../../etc/passwd"),
                   r"\.metadata names '\.\./\.\./\.\./etc/passwd', a path outside"),
    "dcp-symlink": ("dcp", lambda f, t: link_out(f, "__0_0.distcp", t / "elsewhere"),
                    r"names '__0_0\.distcp', a link to .*/elsewhere outside"),
}


@pytest.mark.parametrize("name", sorted(TRAVERSALS))
def test_files_a_checkpoint_names_stay_inside_it(trained_run, formats, tmp_path, capsys, name):
    fmt, craft, message = TRAVERSALS[name]
    if fmt == "hf":
        folder = tmp_path / "hf"
        shutil.copytree(formats["hf"], folder)
    else:
        folder = clone(trained_run, tmp_path / "run") / STEP
    craft(folder, tmp_path)
    before = tree_hash(folder)
    assert re.search(message, error_line(cli(["convert", folder, tmp_path / "out", "--to", "meta"], capsys)))
    assert tree_hash(folder) == before and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- impossible model sizes


N_HEADS_ZERO = {
    "params.json": ("meta", "params.json", {"n_heads": 0}),
    "config.json": ("hf", "config.json", {"num_attention_heads": 0}),
    "titanctl.json": ("dcp", "titanctl.json", None),
}


@pytest.mark.parametrize("name", sorted(N_HEADS_ZERO))
def test_zero_heads_is_one_line_not_a_division_by_zero(trained_run, formats, tmp_path, capsys, name):
    fmt, file, change = N_HEADS_ZERO[name]
    if fmt == "dcp":
        folder = clone(trained_run, tmp_path / "run") / STEP
        bomb_titanctl_json(folder, n_heads=0)
    else:
        folder = tmp_path / fmt
        shutil.copytree(formats[fmt], folder)
        bomb_json(folder / file, **change)
    line = error_line(cli(["convert", folder, tmp_path / "out", "--to", "torchtune"], capsys))
    key = "num_attention_heads" if file == "config.json" else "n_heads"  # config.json's reader names its own key
    assert re.search(rf"{re.escape(file)}: {key} is 0, expected an integer >= 1", line), line


# ----------------------------------------------------------------------------- file-system faults


@pytest.mark.parametrize(
    "content, message",
    [
        ("six", r"titanctl\.json: 'step' is 'six', expected a non-negative integer"),
        ("list", r"titanctl\.json holds a JSON list, expected an object"),
    ],
)
@pytest.mark.parametrize("command", ["convert", "resume"])
def test_titanctl_json_of_the_wrong_type(trained_run, tmp_path, capsys, content, message, command):
    step = clone(trained_run, tmp_path / "run") / STEP
    meta = json.loads((step / "titanctl.json").read_text())
    rewrite(step / "titanctl.json", json.dumps({**meta, "step": "six"} if content == "six" else [meta]).encode())
    before = tree_hash(tmp_path / "run" / "checkpoint")
    assert re.search(message, error_line(cli(PATHS[command](tmp_path, step), capsys)))
    assert tree_hash(tmp_path / "run" / "checkpoint") == before


@pytest.mark.parametrize("target", ["empty", "missing"])
def test_convert_to_a_symlink_is_refused(trained_run, tmp_path, capsys, target):
    if target == "empty":
        (tmp_path / "target").mkdir()
    (tmp_path / "dst").symlink_to(tmp_path / "target")
    line = error_line(cli(["convert", trained_run / STEP, tmp_path / "dst", "--to", "hf"], capsys))
    assert re.search(r"destination .*/dst is a symbolic link \(to .*/target\)", line), line
    assert os.readlink(tmp_path / "dst") == str(tmp_path / "target")
    assert (tmp_path / "target").exists() == (target == "empty")
    assert target == "missing" or not any((tmp_path / "target").iterdir())


def test_convert_into_its_own_source_is_refused(formats, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(formats["hf"], src)
    before = tree_hash(src)
    line = error_line(cli(["convert", src, src / "sub", "--to", "dcp"], capsys))
    assert re.search(r"destination .*/hf/sub is inside the source folder .*/hf", line), line
    assert tree_hash(src) == before


def test_partial_folders_of_a_killed_convert_are_removed(formats, tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that no longer runs
    leftover = tmp_path / f".out.partial-{dead.pid}"
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    proc = cli(["convert", formats["hf"], tmp_path / "out", "--to", "dcp"], capsys)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # One whose lock is held is another conversion at work: refused, left alone (a live PID alone
    # proves nothing: PIDs are reused; tests/cli/test_convert_interruptions.py).
    busy = tmp_path / f".again.partial-{os.getppid()}"
    busy.mkdir()
    lock = os.open(tmp_path / f"{busy.name}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    line = error_line(cli(["convert", formats["hf"], tmp_path / "again", "--to", "dcp"], capsys))
    os.close(lock)
    assert f"another conversion (process {os.getppid()}) is writing" in line and busy.is_dir()
