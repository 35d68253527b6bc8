"""Private torch names: all of them are in titanctl._torch_compat, and this torch has every one.

A torch upgrade that moves an internal fails ``test_this_torch_has_every_private_name`` with the
list of what moved (instead of a user's run failing); a module that reaches a private torch name
itself fails ``test_no_module_reaches_a_private_torch_name_itself``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from titanctl import _torch_compat
from titanctl.errors import TorchInternalsError
from titanctl.parallel.converters.float8 import torchao_float8

PACKAGE = REPO / "titanctl"
COMPAT = PACKAGE / "_torch_compat.py"
TORCH_PACKAGES = ("torch", "torchao")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_this_torch_has_every_private_name() -> None:
    torchao_float8()  # imports torchao without its import-time warnings
    missing = _torch_compat.missing()
    assert not missing, (
        f"torch {torch.__version__} lacks {len(missing)} private name(s) titanctl relies on "
        "(see titanctl/_torch_compat.py for what each is used for):\n" + "\n".join(missing)
    )


def test_a_missing_name_fails_its_feature_with_the_torch_version() -> None:
    for entry in (
        _torch_compat.Private("torch.distributed._no_such_module.thing", "feature X"),
        _torch_compat.Private("torch.distributed.device_mesh.DeviceMesh._no_such_method", "feature X"),
        _torch_compat.Private("torch.distributed.device_mesh.DeviceMesh", "feature X", instance_attr="_no_such"),
        _torch_compat.Private("torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE", "feature X", equals="x"),
    ):
        with pytest.raises(TorchInternalsError) as info:
            entry.get()
        message = str(info.value)
        assert "feature X" in message and torch.__version__ in message, message
        assert entry.name in message and _torch_compat.TESTED_TORCH in message, message
    entry = _torch_compat.Private("torch.distributed.device_mesh.DeviceMesh._no_such_method", "feature Z")
    with pytest.raises(TorchInternalsError, match=r"feature Z needs .*_no_such_method.*object has no \._no_such"):
        entry.of(object())
    with pytest.raises(TorchInternalsError, match=r"feature Y: torch .* internals changed \(a schema\)"):
        _torch_compat.require(False, "feature Y", "a schema")


def test_only_the_entries_of_this_torch_release_are_looked_up(monkeypatch) -> None:
    here = torch.__version__
    absent = "torch.distributed._no_such_module.thing"
    entries = [
        _torch_compat.Private(absent, "older feature", torch_versions="<1.0"),
        _torch_compat.Private(absent, "newer feature", torch_versions=">=99.0"),
        _torch_compat.Private(absent, "this feature", torch_versions=f">={here}"),
    ]
    monkeypatch.setattr(_torch_compat, "ENTRIES", entries)
    assert [e.applies for e in entries] == [False, False, True]
    assert [line.split(":")[0] for line in _torch_compat.missing()] == [f"{absent} (this feature)"]


@pytest.mark.parametrize(("version", "release", "expected"), [
    ("2.13.0+cpu", "2.15", False), ("2.14.1", "2.15", False), ("2.15.0+cu132", "2.15", True),
    ("2.16.0a0+git1234", "2.15", True), ("3.0.0", "2.15", True), ("2.9.1", "2.15", False), ("2.15.0", "2.9", True),
])
def test_torch_at_least_compares_releases(monkeypatch, version, release, expected) -> None:
    monkeypatch.setattr(_torch_compat, "torch_version", lambda: version)
    assert _torch_compat.torch_at_least(release) is expected
    assert _torch_compat.Private("x", "y", torch_versions=f">={release}").applies is expected
    assert _torch_compat.Private("x", "y", torch_versions=f"<{release}").applies is not expected


def test_a_malformed_release_range_is_refused() -> None:
    with pytest.raises(ValueError, match="'2.15' is not '<X.Y' or '>=X.Y'"):
        _ = _torch_compat.Private("x", "y", torch_versions="2.15").applies


class _Owner:
    @classmethod
    def kind(cls) -> str:
        return "original"


def test_patched_puts_a_classmethod_back_as_a_classmethod() -> None:
    entry = _torch_compat.Private(f"{__name__}._Owner.kind", "a feature")
    before = vars(_Owner)["kind"]
    with _torch_compat.patched(entry, staticmethod(lambda: "replaced")) as original:
        assert _Owner.kind() == "replaced" and original() == "original"
    assert vars(_Owner)["kind"] is before and _Owner.kind() == "original"


def test_every_entry_says_what_it_is_for() -> None:
    """Each entry sits in a block of lines that starts with a comment (what for, why no public API)."""
    lines = COMPAT.read_text().splitlines()
    uncommented = []
    for node in ast.parse(COMPAT.read_text()).body:
        if not isinstance(node, ast.Assign) or "_private(" not in ast.get_source_segment(COMPAT.read_text(), node):
            continue
        first = node.lineno - 1
        while first > 0 and lines[first - 1].strip():
            first -= 1
        if not lines[first].lstrip().startswith("#"):
            uncommented.append(f"line {node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not uncommented, "entries without a comment saying what they are for:\n" + "\n".join(uncommented)


def test_importing_the_compat_module_imports_no_torch() -> None:
    code = "import sys, titanctl._torch_compat; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_fake_process_group_needs_no_private_store() -> None:
    """estimate-memory's fake process group passes no store (torch 2.13 makes the fake backend's
    FakeStore itself), so titanctl needs no entry for torch.testing._internal's FakeStore."""
    code = (
        "import torch.distributed as dist\n"
        "from titanctl.planning.memory import fake_process_group\n"
        "with fake_process_group(8, 3):\n"
        "    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (3, 8, 'fake')\n"
        "    dist.all_reduce(__import__('torch').ones(2))\n"
        "assert not dist.is_initialized()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# --- who reaches private torch names --------------------------------------------------------------


def _owned_private_names() -> set[str]:
    """Private names titanctl defines itself (functions, classes, variables, attributes)."""
    owned: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                owned.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                owned.add(node.id)
            elif isinstance(node, ast.arg):
                owned.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    owned.add(node.attr)  # (not stage._recv_meta = ...: that one is torch's)
    return {name for name in owned if _private(name)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _torch_family_sources(module: str, class_name: str) -> str:
    """The source of the torch classes a titanctl class derives from, or its subclasses do (mixins)."""
    cls = getattr(importlib.import_module(module), class_name, None)
    if not isinstance(cls, type):
        return ""
    family, stack = set(cls.__mro__), list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        family |= set(sub.__mro__)
        stack += sub.__subclasses__()
    return "\n".join(
        source for klass in family if klass.__module__.split(".")[0] in TORCH_PACKAGES
        for source in _torch_compat._class_sources(klass)
    )


class _Scanner(ast.NodeVisitor):
    """Private torch names one file reaches: (line, name) with names like ``torch.a._b.c`` (full
    path known), ``*._x`` (an attribute of an object of unknown type) or ``self._x`` (of a class
    derived from a torch class)."""

    def __init__(self, path: Path, owned: set[str], module: str | None = None) -> None:
        self.path, self.owned, self.found = path, owned, []
        self.module = module or _module_name(path)
        self.torch_names: dict[str, str] = {}  # local name -> the torch object's dotted path
        self.other_modules: set[str] = set()
        self.classes: list[tuple[str, str]] = []  # (class name, torch family source), innermost last
        self.inner: set[int] = set()  # Attribute nodes that are the base of another Attribute

    def run(self) -> list[tuple[int, str]]:
        tree = ast.parse(self.path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                self.inner.add(id(node.value))
        self.visit(tree)
        return self.found

    def _torch_path(self, node: ast.AST) -> list[str] | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.torch_names:
            return [self.torch_names[node.id], *reversed(parts)]
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            if top in TORCH_PACKAGES:
                self.torch_names[alias.asname or top] = alias.name if alias.asname else top
                if any(_private(p) for p in alias.name.split(".")):
                    self.found.append((node.lineno, alias.name))
            else:
                self.other_modules.add(alias.asname or top)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            if module.split(".")[0] in TORCH_PACKAGES:
                self.torch_names[alias.asname or alias.name] = f"{module}.{alias.name}"
                if any(_private(p) for p in module.split(".")) or _private(alias.name):
                    self.found.append((node.lineno, f"{module}.{alias.name}"))
            else:
                self.other_modules.add(alias.asname or alias.name)

    def visit_Assign(self, node: ast.Assign) -> None:
        path = self._torch_path(node.value)
        if path is not None:  # aten = torch.ops.aten
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.torch_names[target.id] = ".".join(path)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        source = _torch_family_sources(self.module, node.name) if not self.classes else ""
        self.classes.append((node.name, source))
        for item in node.body:  # overriding a private method of a torch base class
            if isinstance(item, ast.FunctionDef) and _private(item.name) and self._torch_knows(item.name):
                self.found.append((item.lineno, f"self.{item.name}"))
        self.generic_visit(node)
        self.classes.pop()

    def _torch_knows(self, name: str) -> bool:
        source = self.classes[-1][1] if self.classes else ""
        return bool(source) and re.search(rf"\b{re.escape(name)}\b", source) is not None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if id(node) not in self.inner:
            self._check_chain(node)
        self.generic_visit(node)

    def _check_chain(self, node: ast.Attribute) -> None:
        path = self._torch_path(node)
        if path is not None:
            dotted = ".".join(path).split(".")
            last = max((i for i, p in enumerate(dotted) if _private(p)), default=None)
            if last is not None:
                self.found.append((node.lineno, ".".join(dotted[: last + 1])))
            return
        chain = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        chain.reverse()
        if not any(_private(p) for p in chain):
            return
        if isinstance(base, ast.Name) and base.id in self.other_modules:
            return  # os._exit and the like
        first = next(p for p in chain if _private(p))
        is_self = (isinstance(base, ast.Name) and base.id in ("self", "cls") and chain[0] == first) or (
            isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
        )
        if is_self:
            if self._torch_knows(first):
                self.found.append((node.lineno, f"self.{first}"))
        elif first not in self.owned:
            self.found.append((node.lineno, f"*.{first}"))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                if name.value not in self.owned:
                    self.found.append((node.lineno, f"*.{name.value}"))
        if isinstance(func, ast.Attribute) and func.attr == "import_module" and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if name.value.split(".")[0] in TORCH_PACKAGES and any(_private(p) for p in name.value.split(".")):
                    self.found.append((node.lineno, name.value))
        self.generic_visit(node)


def _findings() -> dict[str, list[tuple[int, str]]]:
    owned = _owned_private_names()
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != COMPAT:
            hits = _Scanner(path, owned).run()
            if hits:
                found[str(path.relative_to(REPO))] = sorted(set(hits))
    return found


@pytest.mark.slow
def test_no_module_reaches_a_private_torch_name_itself() -> None:
    """Except that a subclass of a torch class may override and read its base's private hooks and state
    (``self._x``), which no function can stand in for, if the compat module registers them (so that the
    lookup test above checks them)."""
    offenders = [
        f"{path}:{line}: {name}" for path, hits in _findings().items()
        for line, name in hits if not (name.startswith("self.") and _registered(name))
    ]
    assert not offenders, (
        "private torch names used outside titanctl/_torch_compat.py (add an entry there and use it):\n"
        + "\n".join(offenders)
    )


def _registered(name: str) -> bool:
    """Whether ``self.<attr>`` is an entry's attribute (its last part or its ``instance_attr``)."""
    attr = name.split(".", 1)[1]
    return any(entry.name.endswith(f".{attr}") for entry in _torch_compat.ENTRIES)


def test_the_scanner_sees_each_way_of_reaching_a_private_name(tmp_path: Path, monkeypatch) -> None:
    """The scanner is not blind: every pattern it is meant to catch is caught, and only those."""
    source = """
import importlib
import torch
import torch._inductor.config as ic
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.pipelining.schedules import _Action
aten = torch.ops.aten

def f(mesh, op, stage):
    stage._send_meta = None
    torch._scaled_mm(1, 2)
    aten._scaled_dot_product_flash_attention_for_cpu.default
    mesh._flatten("x")
    getattr(op, "_schema")
    importlib.import_module("torch.distributed._symmetric_memory")

class Hooked(ModTracker):
    def _fw_pre_hook(self, mod, input):
        super()._fw_pre_hook(mod, input)

class Peaks:
    def current(self):
        return self._curr_mem_snap, self._own_thing

class Tracker(Peaks, MemTracker):
    pass

class Block(nn.Module):
    def forward(self):
        self._own_thing = 1
        return self._modules
"""
    (tmp_path / "scanner_example.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {name for _, name in _Scanner(tmp_path / "scanner_example.py", {"_own_thing"}, "scanner_example").run()}
    assert names == {
        "torch._inductor.config",
        "torch.distributed._tools.mem_tracker.MemTracker",
        "torch.distributed._tools.mod_tracker.ModTracker",
        "torch.distributed.pipelining.schedules._Action",
        "torch._scaled_mm",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "*._flatten",
        "*._schema",
        "*._send_meta",
        "torch.distributed._symmetric_memory",
        "self._fw_pre_hook",  # an overridden private hook, and the call of torch's own
        "self._curr_mem_snap",  # in a mixin: torch's through the class that mixes it in
        "self._modules",
    }, names


@pytest.mark.parametrize("release, applies", [("2.11.0", False), ("2.12.1", True), ("2.14.1", True), ("2.15.0", False)])
def test_a_release_range_may_have_both_bounds(monkeypatch, release, applies) -> None:
    monkeypatch.setattr(_torch_compat, "torch_version", lambda: release)
    assert _torch_compat.Private("x", "y", torch_versions=">=2.12,<2.15").applies is applies
