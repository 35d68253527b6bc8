"""Every relative link of README.md and docs/*.md points at a file that exists, and every #anchor at a
heading of the page it names, spelled as GitHub spells heading anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lowercased, punctuation (anything but
    letters, digits, '_', '-' and spaces) dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of `page` that does not resolve."""
    problems = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if SCHEME.match(target):
                continue  # https:, mailto:: not ours to check
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{where} (no heading with that anchor in {dest.name})")
            elif anchor and dest.suffix != ".md":
                problems.append(f"{where} (an anchor into a file that is not Markdown)")
    return problems


def test_every_relative_link_and_anchor_resolves(repo):
    problems = [p for page in pages(repo) for p in broken_links(page, repo)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Memory estimate: `titanctl estimate-memory`", "memory-estimate-titanctl-estimate-memory"),
        ("Keys (`[checkpoint]`)", "keys-checkpoint"),
        ("Bringing Meta's Llama 3.1 8B in", "bringing-metas-llama-31-8b-in"),
        ("What makes it fast (and why that is exact)", "what-makes-it-fast-and-why-that-is-exact"),
        ("Hangs: Flight Recorder", "hangs-flight-recorder"),
        ("`[lr_scheduler]`", "lr_scheduler"),
        ("Paths a file names, and what reaches the console from them",
         "paths-a-file-names-and-what-reaches-the-console-from-them"),
    ],
)
def test_anchors_are_spelled_as_github_spells_them(heading, anchor):
    assert slug(heading) == anchor


def test_a_repeated_heading_gets_a_number_and_code_is_not_a_heading():
    text = "# Tests\n## Limits\n```bash\n# Limits in a comment\n```\n### Limits\n## Limits\n"
    assert anchors(text) == {"tests", "limits", "limits-1", "limits-2"}


def test_broken_links_and_anchors_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Options\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#options) [here](#top) [web](https://example.com/x#y) `[code](nowhere.md)`\n"
        "# Top\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#flags) [self](#nothing)\n"
        "```\n[in a fence](missing.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "README.md:3: docs/b.md (no such file)",
        "README.md:3: docs/a.md#flags (no heading with that anchor in a.md)",
        "README.md:3: #nothing (no heading with that anchor in README.md)",
    ]


def test_docs_pages_named_in_code_exist(repo):
    """A `docs/NAME.md` named in code, tests, scripts, benchmarks or recipes is a page that exists."""
    sources = [repo / "Makefile", repo / "pyproject.toml"]
    for folder in ("titanctl", "tests", "scripts", "benchmarks", "recipes", "slurm"):
        sources += [p for p in (repo / folder).rglob("*") if p.suffix in (".py", ".toml", ".sh", ".slurm")]
    sources.remove(Path(__file__).resolve())  # its own examples name pages that do not exist
    missing = sorted({f"{path.relative_to(repo)}: {name}" for path in sources
                      for name in re.findall(r"docs/[\w.-]+\.md", path.read_text(errors="replace"))
                      if not (repo / name).is_file()})
    assert not missing, "\n".join(missing)
