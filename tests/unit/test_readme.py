from titanctl.config.recipe import reference_table


def test_readme_config_reference_is_current(repo):
    readme = (repo / "README.md").read_text()
    assert reference_table() in readme, "run: python scripts/config_reference.py, and paste it into README.md"


def test_readme_opens_with_the_two_commands(repo):
    head = (repo / "README.md").read_text()[:800]
    assert "make train" in head and "make test" in head
