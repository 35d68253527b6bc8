import importlib.util
import re

README_MAX_LINES = 250


def script(repo, name):
    """scripts/NAME.py, loaded as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, repo / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_page_is_current(repo):
    expected = script(repo, "config_reference").render()
    assert (repo / "docs" / "config.md").read_text() == expected, "run: python scripts/config_reference.py --write"


def test_code_map_is_current(repo):
    """docs/development.md's "Layout of the code" is the module docstrings' first sentences, every module."""
    module = script(repo, "code_map")
    assert (repo / "docs" / "development.md").read_text() == module.page_with_map(), (
        "run: python scripts/code_map.py --write")
    listed = module.render()
    unlisted = [p.name for p in (repo / "titanctl").rglob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in listed]
    assert not unlisted, unlisted


def test_config_reference_page_has_every_key(repo):
    from titanctl.config.recipe import field_specs

    page = (repo / "docs" / "config.md").read_text()
    missing = [key for key in field_specs() if f"| `{key}` |" not in page]
    assert not missing, missing


def test_readme_opens_with_the_two_commands(repo):
    head = (repo / "README.md").read_text()[:800]
    assert "make train" in head and "make test" in head


def test_readme_is_a_front_door(repo):
    readme = (repo / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    # Every row of the features table sends the reader to exactly one page under docs/.
    table = readme.split("## Features\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert rows
    for row in rows:
        links = re.findall(r"\]\(([^)]*)\)", row)
        assert len(links) == 1 and links[0].startswith("docs/"), row
