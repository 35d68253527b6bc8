"""The package layering holds: no import cycle between titanctl's packages, nor between its modules."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "titanctl"


def _package_of(module: str) -> str:
    """titanctl.checkpoint.formats.hf -> checkpoint; titanctl.errors -> errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (local ones included), not those under ``if TYPE_CHECKING:``."""
    found = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    walk(orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def _imported_modules(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The titanctl modules an import statement loads (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, up level - 1 packages
            package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return [name for name in names if name in MODULES]


def module_graph() -> dict[str, set[str]]:
    """{module: the titanctl modules it imports}, over every import that runs."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = graph.setdefault(module, set())
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            targets.update(t for t in _imported_modules(node, module) if t != module)
    return graph


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: [modules that import it]}} over every import, local ones included."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, targets in module_graph().items():
        source = _package_of(module)
        for target in targets:
            if _package_of(target) != source:
                graph.setdefault(source, {}).setdefault(_package_of(target), []).append(module)
    return graph


def strongly_connected(graph: dict[str, set[str]] | dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The cycles of a directed graph: its strongly connected components of more than one node
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _describe(component: list[str], graph: dict) -> str:
    edges = [f"  {a} -> {b}" for a in component for b in sorted(graph.get(a, ())) if b in component]
    return " / ".join(component) + ":\n" + "\n".join(edges)


def test_no_import_cycle_between_packages():
    graph = import_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(
        _describe(c, graph) + "\n  (modules: " + "; ".join(
            f"{a} -> {b}: {sorted(set(graph[a][b]))}" for a in c for b in graph.get(a, {}) if b in c
        ) + ")"
        for c in cycles
    )


def test_no_import_cycle_between_modules():
    """Also within a package, and also when a function-local import is what keeps it from failing."""
    graph = module_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles between modules:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_cycle_finder_finds_cycles_of_any_length():
    assert strongly_connected({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert sorted(strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}})) == [
        ["a", "b"], ["c", "d", "e"]
    ]


def test_the_graph_sees_local_and_package_imports():
    graph = module_graph()
    # a module-level import, a from-package import of a submodule, and a function-local import
    assert "titanctl.errors" in graph["titanctl.config.recipe"]
    assert "titanctl.parallel.runtime.elastic" in graph["titanctl.cli.console"]
    assert "titanctl.observability.profile_run" in graph["titanctl.cli.profile"]  # inside the command function


# The rooms of titanctl/, lowest first (docs/development.md's map says what each holds). A room imports
# only rooms of lower levels; rooms of one level do not import each other, but for the one-file modules
# at the bottom. ``rl`` (a stage over train and inference, issue 59) has its level before its room exists.
LAYERS = [
    ("errors", "_torch_compat", "deadline", "gc_pauses", "safe_io", "host_memory", "_inductor_cache", "titanctl"),
    ("config",),
    ("data", "models"),
    ("parallel",),
    ("checkpoint",),
    ("train", "inference"),
    ("planning", "observability", "rl"),
    ("cli",),
    ("__main__",),
]


def layer_violations(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Package imports that go up or sideways in LAYERS, and packages on no layer."""
    level = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}
    found = [f"{room} is on no layer" for room in sorted(set(graph) | {t for ts in graph.values() for t in ts})
             if room not in level]
    for source, targets in sorted(graph.items()):
        for target, modules in sorted(targets.items()):
            if source in level and target in level and (level[target] > level[source] or (
                    level[target] == level[source] and level[source] > 0)):
                found.append(f"{source} imports {target} (a room it sits not above): {sorted(set(modules))[:3]}")
    return found


def test_rooms_import_only_lower_layers():
    assert not (found := layer_violations(import_graph())), "\n".join(found)


def test_the_layer_rule_sees_up_and_sideways_imports():
    graph = {"train": {"inference": ["titanctl.train.x"]}, "models": {"cli": ["titanctl.models.y"]},
             "safe_io": {"errors": ["titanctl.safe_io"]}, "tools": {"errors": ["titanctl.tools.z"]}}
    assert layer_violations(graph) == [
        "tools is on no layer",
        "models imports cli (a room it sits not above): ['titanctl.models.y']",
        "train imports inference (a room it sits not above): ['titanctl.train.x']",
    ]


def test_the_model_knows_nothing_of_parallelism_or_training():
    below_model = {"errors", "config", "models", "_torch_compat"}  # the last: private torch names, e.g. grouped GEMMs
    offenders = {b: m for b, m in import_graph().get("models", {}).items() if b not in below_model}
    assert not offenders, offenders


def test_no_module_outside_models_imports_a_family():
    """parallel/, checkpoint/, train/, inference/, planning/ (and everything else) reach a family through
    titanctl.models.registry: adding a family edits no module outside titanctl/models/."""
    from titanctl.models.registry import FAMILIES

    family_packages = {spec_module.rpartition(".")[0] for spec_module in FAMILIES.values()}
    assert family_packages >= {"titanctl.models.llama", "titanctl.models.qwen3"}
    offenders = [
        f"{module} imports {target}"
        for module, targets in module_graph().items()
        if not module.startswith("titanctl.models")
        for target in sorted(targets)
        if any(target == package or target.startswith(package + ".") for package in family_packages)
    ]
    assert not offenders, "modules outside titanctl/models import a family:\n" + "\n".join(offenders)


def test_the_import_rule_has_teeth(tmp_path):
    """The rule sees an import of a family from outside models/ (parsed the same way as the tree)."""
    tree = ast.parse("from titanctl.models.qwen3.args import QWEN3_FLAVORS\nimport titanctl.models.llama.spec\n")
    seen = {t for node in _runtime_imports(tree) for t in _imported_modules(node, "titanctl.train.trainer")}
    assert seen == {"titanctl.models.qwen3.args", "titanctl.models.llama.spec"}


def test_config_lists_every_family_and_flavor_of_the_registry():
    from titanctl.config.job_config import MODEL_FLAVORS
    from titanctl.models.registry import FAMILIES, get_spec

    assert {name: tuple(get_spec(name).flavors) for name in FAMILIES} == MODEL_FLAVORS


def _floor_of(module: str, floors: list[tuple[str, tuple[str, ...]]]) -> int | None:
    for rank, (_, prefixes) in enumerate(floors):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def upward_imports(graph: dict[str, set[str]], package: str, floors: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Imports between modules of ``package`` that go to a higher floor, and its modules on no floor."""
    found = []
    for module, targets in sorted(graph.items()):
        if not module.startswith(package + "."):
            continue
        own = _floor_of(module, floors)
        if own is None:
            found.append(f"{module} is on no floor")
            continue
        for target in sorted(targets):
            other = _floor_of(target, floors)
            if other is not None and other > own:
                found.append(f"{module} ({floors[own][0]}) imports {target} ({floors[other][0]})")
    return found


# checkpoint/'s floors, lowest first (titanctl/checkpoint/__init__.py says what each holds).
CHECKPOINT_FLOORS = [
    ("trust", ("titanctl.checkpoint.trust",)),
    ("quantized", ("titanctl.checkpoint.quantized",)),
    ("hugging face", ("titanctl.checkpoint.hf",)),
    ("formats", ("titanctl.checkpoint.formats", "titanctl.checkpoint.locate")),
    ("lora", ("titanctl.checkpoint.lora",)),
    ("the run's own", ("titanctl.checkpoint.run",)),
    ("top", ("titanctl.checkpoint.convert", "titanctl.checkpoint.weights")),
]


def test_checkpoint_floors_import_only_downward():
    assert not (found := upward_imports(module_graph(), "titanctl.checkpoint", CHECKPOINT_FLOORS)), "\n".join(found)


def test_the_floor_rule_sees_upward_and_unplaced_modules():
    floors = [("low", ("p.low",)), ("high", ("p.high",))]
    graph = {"p.low.a": {"p.high.b", "p.low.c"}, "p.high.b": {"p.low.a"}, "p.low.c": set(), "p.stray": set()}
    assert upward_imports(graph, "p", floors) == ["p.low.a (low) imports p.high.b (high)", "p.stray is on no floor"]


# String literals of models/common/ that spell a family's name and mean something else, with why.
NOT_A_FAMILY = {
    ("args.py", "llama3"): "ModelArgs.family's default: titanctl.json files older than the field were all of it",
    ("hf_config.py", "llama3"): "Hugging Face's rope_type of the frequency-dependent RoPE scaling, a format's word",
}


def family_mentions(path: Path, stems: set[str]) -> list[str]:
    """Where the source of ``path`` names a family, by the stem of its registry name (llama, qwen...):
    identifiers, comments, docstrings and string literals, case-insensitively, but for NOT_A_FAMILY."""
    import io
    import re
    import tokenize

    pattern = re.compile(rf"(?<![a-z])({'|'.join(sorted(stems))})", re.IGNORECASE)
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type not in (tokenize.NAME, tokenize.COMMENT, tokenize.STRING) or not pattern.search(token.string):
            continue
        if token.type == tokenize.STRING and (path.name, ast.literal_eval(token.string)) in NOT_A_FAMILY:
            continue
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        found.append(f"{where}:{token.start[0]}: {token.string[:80]}")
    return found


def family_stems() -> set[str]:
    import re

    from titanctl.models.registry import FAMILIES

    return {re.match("[a-z]+", name).group() for name in FAMILIES}


def test_nothing_in_common_names_a_family():
    """models/common/ holds what every family shares: no module there imports a family or names one (in
    code, comments or docstrings); a family's own modules live in its folder and reach the shared
    decoder through its spec (``decoder.Blocks``)."""
    from titanctl.models.registry import FAMILIES

    family_packages = {spec_module.rpartition(".")[0] for spec_module in FAMILIES.values()}
    graph = module_graph()
    imports = [f"{m} imports {t}" for m, targets in graph.items() if m.startswith("titanctl.models.common")
               for t in sorted(targets)
               if any(t == p or t.startswith(p + ".") for p in family_packages)]
    assert not imports, imports
    mentions = [line for path in sorted((PACKAGE / "models" / "common").glob("*.py"))
                for line in family_mentions(path, family_stems())]
    assert not mentions, "models/common/ names a family:\n" + "\n".join(mentions)


def test_the_family_rule_sees_every_kind_of_mention(tmp_path):
    """A docstring, an identifier, a comment and string literals (the allowed ones only in their file)."""
    (tmp_path / "args.py").write_text('"""For Qwen3."""\nclass LlamaBlock:  # as DeepSeek-V3 does\n    kind = "gpt_oss"\n'
                                      'x = "llama3"\n')
    (tmp_path / "other.py").write_text('x = "llama3"\n')
    assert family_stems() >= {"llama", "qwen", "deepseek", "gpt"}
    assert [line.split(": ")[0] for line in family_mentions(tmp_path / "args.py", family_stems())] == [
        "args.py:1", "args.py:2", "args.py:2", "args.py:3"]
    assert family_mentions(tmp_path / "other.py", family_stems()) == ['other.py:1: "llama3"']


def test_the_code_map_shows_the_rooms_top_down():
    """docs/development.md's map (scripts/code_map.py) lists the rooms in LAYERS' order, from the top."""
    from tests.unit.test_readme import script

    level = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}
    rooms = script(REPO, "code_map").ROOMS
    assert [level[room] for room in rooms] == sorted((level[room] for room in rooms), reverse=True)
