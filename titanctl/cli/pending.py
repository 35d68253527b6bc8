"""Subcommands whose core is not built yet say so plainly."""

from titanctl.errors import TitanError


def not_yet(command: str, issue: int) -> TitanError:
    return TitanError(f"'titanctl {command}' is not available yet (planned in issue #{issue})")
