"""What one rendering of a chat template may build: every string and list an operation makes,
bounded before it is made.

Jinja's sandbox bounds what a template may reach, not what it may build:
``'a'.ljust(10**6).replace(' ', 'x' * 5000)`` makes 5 GB in one call, and so do
``('y' * 4000000).join(...)``, ``'%*s' % (5000000000, 'a')``, ``('\\t' * 5000).expandtabs(10**6)``
and ``[1] * 5000 | tojson(indent=10**6)``; a ``{% set %}`` block, a macro or a ``{% filter %}`` block
looping over a 4 MB string joins its pieces only once it ends. So:

- every operation that can make a value larger than its inputs (the string methods and filters
  below, ``+``, ``*``, ``%``, ``~``, ``str.format``, a block's join, a printed value) has the size
  of its result predicted from its inputs first, and over ``MAX_VALUE_CHARS`` it is refused before
  it runs (``check``, ``rendered_size``);
- what the operations make is counted against one rendering's ``Budget``: at most
  ``MAX_RENDER_CHARS`` characters and list items in all, so a template holds at most that at once
  (256 MiB at 4 bytes a character).
Breaking either raises ``Bound``, which the template's caller turns into a one-line refusal.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import string
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any

MAX_ARGUMENT = 1_000_000  # the largest integer a template may hand a call or filter
MAX_VALUE_CHARS = 4_000_000  # the longest string or list one operation may build
# What one rendering may build in all: Llama 3.1's, Qwen3's and trl's qwen3_training templates build
# 3.5 to 5 characters and items per character of the conversation they render (measured on a 2 MB one
# of 400 turns: 7 to 10 million), and a conversation has at most chat.MAX_CONVERSATION_CHARS (2 Mi).
MAX_RENDER_CHARS = 1 << 26
_ESCAPED = 10  # the most characters repr() or JSON writes for one character of a string ('\U000e0000')
# printf-style conversions: flags, then width and precision
PRINTF_SIZES = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?")


class Bound(Exception):
    """An operation of the template would build too much (the message names the operation)."""


def check(size: int, what: str) -> int:
    if size > MAX_VALUE_CHARS:
        raise Bound(f"{what} would build a value of {size:,} characters or items, more than {MAX_VALUE_CHARS:,}")
    return size


def check_arguments(args: tuple, kwargs: dict, what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise Bound(f"{what} was given {value}, more than {MAX_ARGUMENT:,}")


class Budget:
    """The characters and items one rendering has built so far (inactive outside a rendering: Jinja
    folds constant expressions when it compiles, where only ``check`` applies)."""

    def __init__(self) -> None:
        self.left: int | None = None

    @contextlib.contextmanager
    def rendering(self) -> Iterator[None]:
        self.left = MAX_RENDER_CHARS
        try:
            yield
        finally:
            self.left = None

    def spend(self, size: int, what: str) -> None:
        if self.left is None:
            return
        self.left -= max(1, size)  # an empty piece still takes a slot of a list
        if self.left < 0:
            raise Bound(f"{what}: the template built more than {MAX_RENDER_CHARS:,} characters and items for one "
                        "conversation")


def size_of(value: Any) -> int:
    """What a finished value counts: a string's characters, a list's items, else 1."""
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 1


def rendered_size(value: Any, limit: int = MAX_VALUE_CHARS, *, indent: int | str | None = None,
                  separators: tuple | None = None) -> int:
    """An upper bound of ``len(str(value))``, and of ``json.dumps(value, indent=indent,
    separators=separators)``, that stops counting past ``limit``: without recursion, holding one
    iterator per level of nesting, in at most ``limit`` steps."""
    if isinstance(value, str):
        return len(value)
    pad = len(indent) if isinstance(indent, str) else max(0, indent) if isinstance(indent, int) else -1
    gaps = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (list, tuple)) else 0
    total, levels = 0, [iter((value,))]  # the items left at each level of nesting
    while levels:
        item = next(levels[-1], _END)
        if item is _END:
            levels.pop()
            continue
        depth = len(levels) - 1
        if isinstance(item, str):
            total += _ESCAPED * len(item) + 2
        elif isinstance(item, bytes):
            total += 4 * len(item) + 3
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, (dict, list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            count = 2 * len(item) if isinstance(item, dict) else len(item)
            each = 4 + gaps + (pad * (depth + 1) + 1 if pad >= 0 else 0)  # separators, a newline and its indent
            total += 16 + count * each + (pad * depth + 1 if pad >= 0 else 0)
            if total <= limit:
                levels.append(itertools.chain.from_iterable(item.items()) if isinstance(item, dict) else iter(item))
        else:
            attrs = _namespace_attrs(item)
            if attrs is not None:
                levels.append(iter((attrs,)))
            total += 64  # the repr of any other object a template can reach is short (a loop, a macro)
        if total > limit:
            return total
    return total


_END = object()


def _namespace_attrs(item: Any) -> dict | None:
    import jinja2.utils

    if isinstance(item, jinja2.utils.Namespace):
        return object.__getattribute__(item, "_Namespace__attrs")
    return None


# ----------------------------------------------------------------------------- what an operation makes


def check_widths(numbers: list[str], what: str) -> None:
    for number in numbers:
        if number and int(number) > MAX_ARGUMENT:
            raise Bound(f"{what} asks for a field of {int(number):,} characters")


def brace_widths(text: str) -> list[str]:
    """The numbers in the format specs of ``text`` (a ``str.format`` string)."""
    try:
        specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(text)]
    except ValueError:  # not a valid format string: str.format will say so
        return []
    return [n for spec in specs for n in re.findall(r"\d+", spec)]


def printf(text: str, values: Any, what: str) -> int:
    """``text % values``: its widths checked; the most it makes, each conversion at most its widest
    argument plus its width (a ``*`` width, taken from the arguments, is checked as an argument)."""
    sizes = PRINTF_SIZES.findall(text)
    check_widths([n for pair in sizes for n in pair], what)
    args = tuple(values.values() if isinstance(values, dict) else values if isinstance(values, tuple) else (values,))
    if "*" in text:
        check_arguments(args, {}, f"{what}'s * width")
    widest = max((rendered_size(a) for a in args), default=0)
    widths = max((int(n) for pair in sizes for n in pair if n), default=0)
    return len(text) + len(sizes) * (widest + widths)


def _fields(text: str) -> int:
    try:
        return sum(1 for _, name, _, _ in string.Formatter().parse(text) if name is not None)
    except ValueError:  # not a format string: str.format will say so
        return 0


def brace_format(text: str, args: tuple, kwargs: dict) -> int:
    """``text.format(*args, **kwargs)``: its widths checked; the most it makes, each field at most the
    widest argument."""
    check_widths(brace_widths(text), "a format string")
    widest = max((rendered_size(a) for a in (*args, *kwargs.values())), default=0)
    return len(text) + _fields(text) * widest


def _replace(s: str, old: Any, new: Any, count: Any = -1) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def join_size(sep: str, items: list) -> int:
    return len(sep) * max(0, len(items) - 1) + sum(rendered_size(x) for x in items)


def _translate(s: str, table: Any) -> int:
    values = table.values() if isinstance(table, dict) else ()
    return len(s) * max([1, *(len(v) for v in values if isinstance(v, str))])


# str methods that can make more than they are given: (str, *args) -> the most characters they make
STR_METHODS = {
    "center": lambda s, width, *_: max(len(s), width),
    "ljust": lambda s, width, *_: max(len(s), width),
    "rjust": lambda s, width, *_: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(0, tabsize),
    "replace": _replace,
    "translate": _translate,
    **{name: lambda s: 3 * len(s) for name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold")},
}


def _indent(s: Any, width: Any = 4, *_: Any) -> int:
    s = str(s) if not isinstance(s, str) else s
    prefix = len(width) if isinstance(width, str) else width
    return len(s) + (s.count("\n") + 1) * max(0, prefix)


def _wordwrap(s: str, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None, *_: Any) -> int:
    return len(s) + (len(s) // max(1, width) + 1) * len(wrapstring if isinstance(wrapstring, str) else "\n")


def _sum(items: list, attribute: Any = None, start: Any = 0) -> int:
    if isinstance(start, (list, tuple)):
        return len(start) + sum(len(x) for x in items if isinstance(x, (list, tuple)))
    return 1


# filters that can make more than they are given: (value, *args) -> the most characters or items they
# make. ``join`` and ``sum`` are handed their iterable as a list.
FILTERS = {
    "center": lambda s, width=80: max(rendered_size(s), width),
    "indent": _indent,
    "wordwrap": _wordwrap,
    "replace": lambda s, old, new, count=None: _replace(str(s), old, new, -1 if count is None else count),
    "format": lambda s, *args, **kwargs: printf(s, kwargs or args, "filter format"),
    "tojson": lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: rendered_size(
        v, indent=indent, separators=separators),
    "join": lambda items, d="", attribute=None: join_size(d if isinstance(d, str) else str(d), items),
    "sum": _sum,
    "string": lambda v: rendered_size(v),
    **{name: lambda v, *_: 6 * rendered_size(v) for name in ("e", "escape", "forceescape", "xmlattr")},  # &#34;
    "urlencode": lambda v: 12 * rendered_size(v),
    **{name: lambda s, *_: 3 * rendered_size(s) for name in ("upper", "lower", "title", "capitalize")},
}
MATERIALIZED = frozenset({"join", "sum"})  # filters whose iterable is listed before its size is predicted


def predict(table: dict, name: str, args: tuple, kwargs: dict) -> int | None:
    """The most that operation ``name`` of ``table`` makes from these arguments; None when it makes no
    more than it is given, or when its arguments are wrong (the operation itself then refuses them)."""
    rule = table.get(name)
    if rule is None:
        return None
    try:
        return rule(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        return None
