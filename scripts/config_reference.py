"""Print the config reference table that README.md embeds, or with --write put it into README.md.

    python scripts/config_reference.py [--write]
"""

import sys
from pathlib import Path

from titanctl.config.recipe import reference_table

README = Path(__file__).resolve().parents[1] / "README.md"


def write_into_readme() -> None:
    """Replace the table under README's "## Config reference" heading."""
    lines = README.read_text().splitlines()
    heading = lines.index("## Config reference")
    start = next(i for i in range(heading, len(lines)) if lines[i].startswith("| key |"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = reference_table().splitlines()
    README.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_into_readme()
    else:
        print(reference_table())
