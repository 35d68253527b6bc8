import importlib.util
import re

README_MAX_LINES = 250


def config_reference(repo):
    """scripts/config_reference.py, loaded as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("config_reference", repo / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_page_is_current(repo):
    expected = config_reference(repo).render()
    assert (repo / "docs" / "config.md").read_text() == expected, "run: python scripts/config_reference.py --write"


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
