"""Every config key does something: some code under titanctl/ reads it as an attribute of its
section. A key nothing reads is a setting silently ignored; a key only the memory estimator
reads must say so in its help text.

How a read is recognised (statically, with ``ast``): ``<expr>.<section>.<key>`` (e.g.
``cfg.float8.filter_fqns``, ``self.cfg.training.seed``), or ``<name>.<key>`` where ``<name>`` is
bound to a section in the same function or class: assigned from ``<expr>.<section>``, or
annotated with the section's dataclass (``cfg: Float8``, also under an import alias), or
assigned from another such name. The loader's generic ``getattr(getattr(cfg, section), name)``
is not a read of any particular key, so it does not count.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from pathlib import Path

import pytest

from titanctl.config.job_config import JobConfig

PACKAGE = Path(__file__).resolve().parents[3] / "titanctl"
MEMORY_ESTIMATOR = PACKAGE / "tools" / "memory"


def sections() -> dict[str, type]:
    return typing.get_type_hints(JobConfig)


class _Reads(ast.NodeVisitor):
    """Collects (section, key) pairs read in one module."""

    def __init__(self, section_classes: dict[str, str]):
        self.class_names = dict(section_classes)  # local class name (or import alias) -> section
        self.sections = set(section_classes.values())
        self.scopes: list[dict[str, str]] = [{}]  # name -> section, innermost last
        self.self_attrs: list[dict[str, str]] = [{}]  # per class: self.<attr> -> section
        self.reads: set[tuple[str, str]] = set()

    # -- what an expression is bound to
    def section_of(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute):
            if node.attr in self.sections and self.section_of(node.value) is None:
                return node.attr
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.self_attrs[-1].get(node.attr)
            return None
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
        return None

    def annotated_section(self, annotation: ast.AST | None) -> str | None:
        if annotation is None:
            return None
        text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
        for part in str(text).replace("|", " ").split():
            name = part.rsplit(".", 1)[-1]
            if name in self.class_names:
                return self.class_names[name]
        return None

    # -- scopes
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "titanctl.config.job_config":
            for alias in node.names:
                if alias.name in self.class_names:
                    self.class_names[alias.asname or alias.name] = self.class_names[alias.name]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        attrs = {}
        for item in node.body:  # dataclass fields typed with a section: self.<field>.<key>
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                section = self.annotated_section(item.annotation)
                if section:
                    attrs[item.target.id] = section
        for sub in ast.walk(node):  # self.<attr> = <section expr>
            if isinstance(sub, ast.Assign):
                section = None
                for target in sub.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        section = section or self._bound(sub.value)
                        if section:
                            attrs[target.attr] = section
        self.self_attrs.append(attrs)
        self.generic_visit(node)
        self.self_attrs.pop()

    def _bound(self, value: ast.AST) -> str | None:
        if isinstance(value, ast.Attribute) and value.attr in self.sections:
            return value.attr
        return self.section_of(value) if isinstance(value, ast.Name) else None

    def _visit_function(self, node) -> None:
        scope = {}
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            section = self.annotated_section(arg.annotation)
            if section:
                scope[arg.arg] = section
        self.scopes.append(scope)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    targets = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = sub.value.elts if isinstance(sub.value, ast.Tuple) else [sub.value]
                    for t, v in zip(targets, values):
                        if isinstance(t, ast.Name):
                            section = self._bound(v)
                            if section:
                                scope[t.id] = section
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        section = self.section_of(node.value)
        if section is not None and isinstance(node.ctx, ast.Load):
            self.reads.add((section, node.attr))
        self.generic_visit(node)


def reads_in(files: list[Path], section_classes: dict[str, str]) -> dict[tuple[str, str], set[Path]]:
    found: dict[tuple[str, str], set[Path]] = {}
    for path in files:
        visitor = _Reads(section_classes)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for read in visitor.reads:
            found.setdefault(read, set()).add(path)
    return found


def unread_keys(config_sections: dict[str, type], files: list[Path]) -> list[str]:
    """Keys no file reads, and keys only the memory estimator reads without saying so in their help."""
    classes = {cls.__name__: name for name, cls in config_sections.items()}
    found = reads_in(files, classes)
    problems = []
    for section, cls in config_sections.items():
        for f in dataclasses.fields(cls):
            readers = found.get((section, f.name), set())
            if not readers:
                problems.append(f"{section}.{f.name}: read nowhere under titanctl/")
            elif all(MEMORY_ESTIMATOR in p.parents for p in readers) and "memory estima" not in f.metadata["help"]:
                problems.append(f"{section}.{f.name}: read only by the memory estimator, and its help does not say so")
    return problems


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_config_key_is_read():
    assert unread_keys(sections(), source_files()) == []


# The walk itself must catch real mistakes: a key added without code, or read through the wrong section.


@dataclasses.dataclass
class Float8:
    enable_float8_linear: bool = False
    never_read: bool = False


@dataclasses.dataclass
class Compile:
    enable: bool = False


@dataclasses.dataclass
class Estimation:
    margin: float = dataclasses.field(default=0.1, metadata={"help": "A margin."})


@dataclasses.dataclass
class DocumentedEstimation:
    margin: float = dataclasses.field(default=0.1, metadata={"help": "A margin (read by the memory estimator only)."})


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "source",
    [
        "def f(cfg):\n    return cfg.float8.enable_float8_linear and cfg.compile.enable\n",
        "def f(cfg):\n    f8 = cfg.float8\n    return f8.enable_float8_linear and cfg.compile.enable\n",
        "def f(c: Float8, d: 'Compile'):\n    return c.enable_float8_linear and d.enable\n",
        "from titanctl.config.job_config import Float8 as F8\ndef f(c: F8, cfg):\n"
        "    return c.enable_float8_linear and cfg.compile.enable\n",
        "class A:\n    def __init__(self, cfg):\n        self.f8 = cfg.float8\n        self.cfg = cfg\n"
        "    def g(self):\n        return self.f8.enable_float8_linear and self.cfg.compile.enable\n",
    ],
)
def test_the_walk_sees_reads_and_flags_the_unread_key(tmp_path, source):
    files = [write(tmp_path, "titanctl/a.py", source)]
    sections = {"float8": Float8, "compile": Compile}
    assert unread_keys(sections, files) == ["float8.never_read: read nowhere under titanctl/"]


def test_a_read_through_another_section_or_a_generic_getattr_does_not_count(tmp_path):
    files = [write(tmp_path, "titanctl/a.py",
                   "def f(cfg, section, name):\n"
                   "    cfg.float8.enable_float8_linear\n"
                   "    cfg.compile.never_read\n"  # the wrong section
                   "    getattr(getattr(cfg, section), name)\n"
                   "    return cfg.compile.enable\n")]
    assert unread_keys({"float8": Float8, "compile": Compile}, files) == [
        "float8.never_read: read nowhere under titanctl/"
    ]


def test_a_key_only_the_memory_estimator_reads_must_say_so(tmp_path, monkeypatch):
    estimator = write(tmp_path, "titanctl/planning/memory/estimate.py", "def f(cfg):\n    return cfg.estimation.margin\n")
    monkeypatch.setattr(sys.modules[__name__], "MEMORY_ESTIMATOR", estimator.parent)
    assert unread_keys({"estimation": Estimation}, [estimator]) == [
        "estimation.margin: read only by the memory estimator, and its help does not say so"
    ]
    assert unread_keys({"estimation": DocumentedEstimation}, [estimator]) == []
    trainer = write(tmp_path, "titanctl/train/x.py", "def g(cfg):\n    return cfg.estimation.margin\n")
    assert unread_keys({"estimation": Estimation}, [estimator, trainer]) == []
