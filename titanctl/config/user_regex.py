"""Regular expressions a user gives (``[[optimizer.groups]] params``, ``lora.target_regex``), checked
before they match anything.

Python's ``re`` backtracks: ``(.*.*)*!`` never finished on a parameter name, and ``.*.*.*.*.*!`` takes
polynomial time. So a pattern is refused, in one line naming the key, when it is longer than
``MAX_PATTERN_CHARS``, does not compile, refers back to a group (``\\1``, ``(?(1)...)``), repeats a
part that can itself match in more than one way (a repeat inside a repeat, or alternatives inside a
repeat: what makes backtracking exponential), or has more than ``MAX_REPEATS`` repeats of varying
length. Names are matched under a time limit (``MAX_MATCH_SECONDS`` for all of a model's names),
so what the shape check lets through cannot hang either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from titanctl.deadline import Expired, time_limit
from titanctl.errors import ConfigError
from titanctl.safe_io import visible

try:
    from re import _parser as _sre_parse  # Python 3.11+
except ImportError:  # Python 3.10
    import sre_parse as _sre_parse

MAX_PATTERN_CHARS = 1000  # canonical names have fewer than 100 characters
MAX_REPEATS = 4  # repeats of varying length (*, +, ?, {m,n}); 'layers\.\d+\..*\.w[13]' has 2
MAX_MATCH_SECONDS = 2.0  # all of a model's names against one pattern (10^4 names take milliseconds)
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
_BACKREFERENCES = ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE")


class UserRegex:
    """A checked pattern of config key ``key``; ``fullmatch`` under the time limit."""

    def __init__(self, key: str, pattern: str) -> None:
        self.key, self.pattern = key, pattern
        self.regex = _compile(key, pattern)

    def matching(self, names: Iterable[str]) -> list[str]:
        """The names the whole pattern matches; a ConfigError past MAX_MATCH_SECONDS."""
        names = list(names)
        try:
            with time_limit(MAX_MATCH_SECONDS):
                return [name for name in names if self.regex.fullmatch(name)]
        except Expired:
            raise ConfigError(f"{self._said()} took more than {MAX_MATCH_SECONDS:g} s to match {len(names):,} "
                              "names: it backtracks; write it without repeats that can match the same text") from None

    def _said(self) -> str:
        return f"config key '{self.key}' = {visible(repr(self.pattern))}"


def check_user_regex(key: str, pattern: str) -> None:
    """Refuse ``pattern`` (the value of config key ``key``) before it matches anything."""
    _compile(key, pattern)


def _compile(key: str, pattern: str) -> re.Pattern:
    said = f"config key '{key}' = {visible(repr(pattern[:80]))}{'...' if len(pattern) > 80 else ''}"
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(f"{said} has {len(pattern):,} characters; a pattern has at most {MAX_PATTERN_CHARS:,}")
    try:
        regex = re.compile(pattern)
        tree = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ConfigError(f"{said} is no regular expression: {e}") from None
    why = _backtracking(tree)
    if why:
        raise ConfigError(f"{said} {why}, which makes Python's regex engine backtrack for ever on a near miss; "
                          "write it without that (e.g. layers\\.\\d+\\.attention\\.w[qkv])")
    return regex


def _backtracking(tree) -> str | None:
    """Why the parsed pattern may backtrack exponentially or by a high power, or None."""
    repeats = 0
    stack = [(list(tree), False)]  # (items, inside a repeat)
    while stack:
        items, inside = stack.pop()
        for op, av in items:
            name = getattr(op, "name", str(op))
            if name in _BACKREFERENCES:
                return "refers back to a group"
            if name in _REPEATS:
                low, high, body = av
                varies = low != high
                if inside and varies:
                    return "repeats a part that holds a repeat of its own"
                repeats += varies
                stack.append((list(body), inside or high > 1))
            elif name == "BRANCH":
                if inside:
                    return "repeats a choice between alternatives"
                stack.extend((list(branch), inside) for branch in av[1])
            elif name == "SUBPATTERN":
                stack.append((list(av[-1]), inside))
            elif name in ("ASSERT", "ASSERT_NOT"):
                stack.append((list(av[1]), inside))
            elif name == "ATOMIC_GROUP":
                stack.append((list(av), inside))
    if repeats > MAX_REPEATS:
        return f"has {repeats} repeats of varying length (at most {MAX_REPEATS})"
    return None
