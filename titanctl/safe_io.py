"""Reading files that come from outside, and writing files in folders that may hold links.

Anything a user, a checkpoint or a download hands titanctl is read through here: only a regular
file (a FIFO or a device would block or never end), never more than a stated number of bytes, and
JSON or TOML only after a scan has shown that its nesting is shallow (CPython's parsers recurse,
and a 10^5-deep document ends in RecursionError or worse). Files titanctl writes into a dump or
destination folder are opened without following a link, so a folder that ships ``metrics.jsonl``
as a link to ``~/.bashrc`` cannot get that file rewritten.
"""

from __future__ import annotations

import json
import os
import stat
import unicodedata
from pathlib import Path

from titanctl.errors import TitanError

# Limits for small structured files (configs, indexes, manifests, lock files, metric rows).
MAX_NESTING = 64
MAX_SMALL_FILE_BYTES = 64 << 20

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NON_BLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def shown(value: object, keep_newlines: bool = False) -> str:
    """``value`` as text safe to print with rich: control characters (escape sequences, carriage
    returns, bidi overrides) made visible as ``\\x1b``-style escapes, and rich markup escaped."""
    from rich.markup import escape

    return escape(visible(str(value), keep_newlines))


def visible(text: str, keep_newlines: bool = False) -> str:
    """``text`` with control and format characters written as Python escapes (newlines and tabs
    kept with ``keep_newlines``, for multi-line text such as generated tokens)."""
    if text.isprintable():
        return text
    kept = " \n\t" if keep_newlines else " "
    return "".join(ch if ch.isprintable() or ch in kept else _escape_char(ch) for ch in text)


def _escape_char(ch: str) -> str:
    if unicodedata.category(ch)[0] not in "CZ" and ch != "\x7f":
        return ch
    return ch.encode("unicode_escape").decode("ascii")


def regular_file_size(path: Path, *, what: str, error: type[TitanError] = TitanError) -> int:
    """Size of ``path`` if it is a regular file (links followed); else one-line ``error``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {shown(path)} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {shown(path)}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {shown(path)} is not a regular file")
    return st.st_size


def read_bytes(
    path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES, error: type[TitanError] = TitanError
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, opened so that a FIFO cannot block."""
    try:
        fd = os.open(path, os.O_RDONLY | _NON_BLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise error(f"{what} {shown(path)} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {shown(path)}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {shown(path)} is not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{what} {shown(path)} has {st.st_size:,} bytes; at most {max_bytes:,} are read")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while being read
                raise error(f"{what} {shown(path)} has more than {max_bytes:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(
    path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES, error: type[TitanError] = TitanError
) -> str:
    """``read_bytes`` decoded as UTF-8; anything else is a one-line ``error``."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {shown(path)} is not UTF-8 text (byte {e.start})") from None


def check_nesting(text: str, *, what: str, max_depth: int = MAX_NESTING, comments: bool = False,
                  error: type[TitanError] = TitanError) -> None:
    """Refuse JSON (or TOML, with ``comments``) whose brackets nest deeper than ``max_depth``,
    before a recursive parser sees it. Brackets inside strings and comments do not count."""
    depth = 0
    quote = None
    escaped = in_comment = False
    for ch in text:
        if in_comment:
            in_comment = ch != "\n"
        elif quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise error(f"{what} nests deeper than {max_depth} levels")
        elif ch in "]}":
            depth -= 1
        elif ch == '"' or (comments and ch == "'"):
            quote = ch
        elif comments and ch == "#":
            in_comment = True


def _check_parsed_depth(value: object, *, what: str, max_depth: int, error: type[TitanError]) -> None:
    """The same limit on the parsed value (TOML's dotted keys nest without brackets)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    raise error(f"{what} nests deeper than {max_depth} levels")
                stack.append((child, depth + 1))


def parse_json(text: str, *, what: str, max_depth: int = MAX_NESTING, error: type[TitanError] = TitanError):
    """``json.loads`` after the nesting check; a syntax error is one line naming ``what``."""
    check_nesting(text, what=what, max_depth=max_depth, error=error)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise error(f"{what} is not valid JSON: {shown(e)}") from None


def parse_toml(text: str, *, what: str, max_depth: int = MAX_NESTING, error: type[TitanError] = TitanError):
    """``tomllib.loads`` after the nesting checks; a syntax error is one line naming ``what``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    check_nesting(text, what=what, max_depth=max_depth, comments=True, error=error)
    try:
        value = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise error(f"{what} is not valid TOML: {shown(e)}") from None
    _check_parsed_depth(value, what=what, max_depth=max_depth, error=error)
    return value


def load_json(path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES,
              error: type[TitanError] = TitanError):
    """A small JSON file from outside: regular, bounded, UTF-8, shallow."""
    text = read_text(path, what=what, max_bytes=max_bytes, error=error)
    return parse_json(text, what=f"{what} {shown(path)}", error=error)


def load_toml(path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES,
              error: type[TitanError] = TitanError):
    """A small TOML file from outside: regular, bounded, UTF-8, shallow."""
    text = read_text(path, what=what, max_bytes=max_bytes, error=error)
    return parse_toml(text, what=f"{what} {shown(path)}", error=error)


def open_no_follow(path: Path, flags: int, mode: int = 0o644, *, what: str,
                   error: type[TitanError] = TitanError) -> int:
    """``os.open`` that refuses a link at ``path`` (one line) and never blocks on a FIFO; a file
    that exists must be a regular file."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW | _NON_BLOCK | _CLOEXEC, mode)
    except OSError as e:
        if os.path.islink(path):
            raise error(f"{what} {shown(path)} is a symbolic link; titanctl does not write through links") from None
        raise error(f"cannot open {what} {shown(path)}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {shown(path)} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_for_append(path: Path, *, what: str, error: type[TitanError] = TitanError):
    """A line-buffered text file opened for appending, not through a link."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, what=what, error=error)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


def create_new(path: Path, *, what: str, mode: int = 0o644, error: type[TitanError] = TitanError):
    """A fresh binary file for writing (``O_EXCL``: neither an existing file nor a link is reused)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _CLOEXEC, mode)
    except FileExistsError:
        raise error(f"{what} {shown(path)} already exists (a leftover temporary file or a link); remove it") from None
    except OSError as e:
        raise error(f"cannot create {what} {shown(path)}: {e.strerror}") from None
    return os.fdopen(fd, "wb")


def replace_atomically(path: Path, data: bytes, *, what: str, error: type[TitanError] = TitanError) -> None:
    """Write ``data`` to a fresh temporary file beside ``path`` and rename it over ``path``: a link
    at ``path`` is replaced by the file, never written through."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.unlink(tmp)  # our own leftover from a killed run with this PID
    except FileNotFoundError:
        pass
    with create_new(tmp, what=what, error=error) as f:
        f.write(data)
    os.replace(tmp, path)
