"""Reading files that come from outside, and writing files in folders that may hold links.

Anything a user, a checkpoint or a download hands titanctl is read through here: only a regular
file (a FIFO or a device would block or never end), never more than a stated number of bytes, and
JSON or TOML only after a scan has shown that its nesting is shallow (CPython's parsers recurse,
and a 10^5-deep document ends in RecursionError or worse). Files titanctl writes into a dump or
destination folder are opened without following a link, so a folder that ships ``metrics.jsonl``
as a link to ``~/.bashrc`` cannot get that file rewritten.
"""

from __future__ import annotations

import fcntl
import functools
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
        raise error(f"{what} {visible(str(path))} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {visible(str(path))}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or is_kernel_file(st):
        raise error(f"{what} {visible(str(path))} is not a regular file")
    return st.st_size


def is_kernel_file(st: os.stat_result) -> bool:
    """Whether ``st`` is a file of /proc or /sys: "regular" files of 0 (or 4096) bytes that the kernel
    fills when read, such as /proc/self/environ (the process's environment, tokens included)."""
    return st.st_dev in _kernel_file_systems()


@functools.lru_cache(maxsize=1)
def _kernel_file_systems() -> frozenset[int]:
    root = os.stat("/").st_dev
    devices = set()
    for mount in ("/proc", "/sys"):
        try:
            device = os.stat(mount).st_dev
        except OSError:
            continue
        if device != root:  # a plain folder where nothing is mounted
            devices.add(device)
    return frozenset(devices)


def read_bytes(
    path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES, error: type[TitanError] = TitanError
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, opened so that a FIFO cannot block."""
    with open_regular(path, what=what, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {visible(str(path))} has {size:,} bytes; at most {max_bytes:,} are read")
        data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # grew while being read
            raise error(f"{what} {visible(str(path))} has more than {max_bytes:,} bytes")
        return data


def open_regular(path: Path, *, what: str, error: type[TitanError] = TitanError):
    """``open(path, "rb")`` for a regular file only: a FIFO or a device is refused, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | _NON_BLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise error(f"{what} {visible(str(path))} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {visible(str(path))}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or is_kernel_file(st):
        os.close(fd)
        raise error(f"{what} {visible(str(path))} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_head(path: Path, size: int, *, what: str, error: type[TitanError] = TitanError) -> bytes:
    """The first ``size`` bytes of a regular file of any length (to tell its kind), never blocking."""
    with open_regular(path, what=what, error=error) as f:
        return f.read(size)


def read_text(
    path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES, error: type[TitanError] = TitanError
) -> str:
    """``read_bytes`` decoded as UTF-8; anything else is a one-line ``error``."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {visible(str(path))} is not UTF-8 text (byte {e.start})") from None


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
        raise error(f"{what} is not valid JSON: {visible(str(e))}") from None


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
        raise error(f"{what} is not valid TOML: {visible(str(e))}") from None
    _check_parsed_depth(value, what=what, max_depth=max_depth, error=error)
    return value


def load_json(path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES,
              error: type[TitanError] = TitanError):
    """A small JSON file from outside: regular, bounded, UTF-8, shallow."""
    text = read_text(path, what=what, max_bytes=max_bytes, error=error)
    return parse_json(text, what=f"{what} {visible(str(path))}", error=error)


def load_toml(path: Path, *, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES,
              error: type[TitanError] = TitanError):
    """A small TOML file from outside: regular, bounded, UTF-8, shallow."""
    text = read_text(path, what=what, max_bytes=max_bytes, error=error)
    return parse_toml(text, what=f"{what} {visible(str(path))}", error=error)


def open_no_follow(path: Path, flags: int, mode: int = 0o644, *, what: str,
                   error: type[TitanError] = TitanError) -> int:
    """``os.open`` that refuses a link at ``path`` (one line) and never blocks on a FIFO; a file
    that exists must be a regular file."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW | _NON_BLOCK | _CLOEXEC, mode)
    except OSError as e:
        if os.path.islink(path):
            raise error(
                f"{what} {visible(str(path))} is a symbolic link; titanctl does not write through links"
            ) from None
        raise error(f"cannot open {what} {visible(str(path))}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {visible(str(path))} is not a regular file")
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
        raise error(
            f"{what} {visible(str(path))} already exists (a leftover temporary file or a link); remove it"
        ) from None
    except OSError as e:
        raise error(f"cannot create {what} {visible(str(path))}: {e.strerror}") from None
    return os.fdopen(fd, "wb")


def cannot_create_in(folder: Path) -> str | None:
    """Why this process cannot create a file in ``folder`` (the system's reason), or None.

    Tried rather than asked: ``os.access`` says yes to root for a folder without write permission
    (where root can indeed write) but also where root cannot (NFS with root squashed), and it
    answers for the real user, not the effective one. A probe file is created and removed again."""
    probe = Path(folder) / f".titanctl-write-probe-{os.getpid()}"
    for attempt in range(2):
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _CLOEXEC, 0o600)
        except FileExistsError:
            if attempt:
                return f"{visible(str(probe))} cannot be replaced"
            try:  # a leftover of a killed process that had this PID
                os.unlink(probe)
            except OSError as e:
                return e.strerror or str(e)
            continue
        except OSError as e:
            return e.strerror or str(e)
        os.close(fd)
        os.unlink(probe)
        return None
    return None


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


# A folder written under a temporary name (``.DST.partial-PID``) and renamed when complete: its writer
# holds an flock on ``PARTIAL.lock`` while it writes, so a leftover folder whose lock nobody holds is a
# dead writer's, whatever process now has that PID.
_HELD_LOCKS: dict[Path, int] = {}


def partial_lock(partial: Path) -> Path:
    return partial.with_name(partial.name + ".lock")


def hold_partial(partial: Path, *, what: str, error: type[TitanError] = TitanError) -> None:
    """Take ``partial``'s lock for this process, until ``release_partial``."""
    fd = open_no_follow(partial_lock(partial), os.O_RDWR | os.O_CREAT, what=what, error=error)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD_LOCKS[partial] = fd


def release_partial(partial: Path) -> None:
    fd = _HELD_LOCKS.pop(partial, None)
    if fd is not None:
        partial_lock(partial).unlink(missing_ok=True)
        os.close(fd)


def partial_in_use(partial: Path) -> bool:
    """Whether a live writer holds ``partial``'s lock (a folder without a lock file is a dead one's)."""
    try:
        fd = os.open(partial_lock(partial), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


# Pickles from outside (DCP indexes, non-tensor items, Flight Recorder dumps), bounded before loading.
MAX_PICKLE_VALUES = 1 << 25  # containers, objects and memo entries that one pickle may build
MAX_PICKLE_STACK = 1 << 22  # values on the unpickler's stack at once

# How the scan sees each opcode: what it does (_KIND) and the size of its argument (_ARG: bytes; for
# _COUNTED the bytes of a length that many bytes of data follow; -1: a line; -2: two lines).
(_MEMOIZE, _GET1, _GET4, _ATOM_OP, _COUNTED, _TUPLE1, _TWO, _EMPTY_TUPLE, _EMPTY, _MARK, _INTO_MARK, _INTO,
 _FROM_MARK, _POP_MARK, _PUT, _GET_LINE, _LINE, _NAME_OP, _STACK_GLOBAL, _POP, _DUP, _PERSID, _NOTHING, _STOP,
 _THREE) = range(25)
_KIND, _ARG = [_STOP] * 256, [0] * 256
for _codes, _kind, _arg in (
    (b"\x94", _MEMOIZE, 0), (b"h", _GET1, 1), (b"j", _GET4, 4), (b"N\x88\x89\x97", _ATOM_OP, 0), (b"K", _ATOM_OP, 1),
    (b"M", _ATOM_OP, 2), (b"J", _ATOM_OP, 4), (b"G", _ATOM_OP, 8), (b"UC\x8c\x8a", _COUNTED, 1),
    (b"TBX\x8b", _COUNTED, 4), (b"\x8d\x8e\x96", _COUNTED, 8), (b"\x85", _TUPLE1, 0), (b"\x86R\x81s", _TWO, 0),
    (b"\x87\x92", _THREE, 0), (b")", _EMPTY_TUPLE, 0), (b"]}\x8f", _EMPTY, 0), (b"(", _MARK, 0),
    (b"eu\x90", _INTO_MARK, 0), (b"ab", _INTO, 0), (b"tld\x91o", _FROM_MARK, 0), (b"i", _FROM_MARK, -2),
    (b"1", _POP_MARK, 0), (b"q", _PUT, 1), (b"r", _PUT, 4), (b"p", _PUT, -1), (b"g", _GET_LINE, -1),
    (b"FILSVP", _LINE, -1), (b"c", _NAME_OP, -2), (b"\x82", _NAME_OP, 1), (b"\x83", _NAME_OP, 2),
    (b"\x84", _NAME_OP, 4), (b"\x93", _STACK_GLOBAL, 0), (b"0", _POP, 0), (b"2", _DUP, 0), (b"Q", _PERSID, 0),
    (b"\x80", _NOTHING, 1), (b"\x95", _NOTHING, 8), (b"\x98", _NOTHING, 0),
):
    for _code in _codes:
        _KIND[_code], _ARG[_code] = _kind, _arg
# What the scan tracks of a value: [depth, state]. A FREE value is mutable and inside nothing yet, so it
# may still grow; once NESTED it may not change. Atoms and imported names share one node each.
_FREE, _NESTED, _FROZEN, _IMPORTED = 0, 1, 2, 3
_ATOM, _NAME, _EMPTY_TUPLE_NODE = [0, _FROZEN], [0, _IMPORTED], [1, _FROZEN]
_FROZEN_RESULT = frozenset(b"\x85\x86\x87t\x91")  # tuples and frozensets; other results are FREE


def check_pickle(data: bytes | bytearray | memoryview, *, what: str, max_depth: int = MAX_NESTING,
                 max_values: int = MAX_PICKLE_VALUES, error: type[TitanError] = TitanError) -> None:
    """Refuse a pickle, before an unpickler sees it, whose values nest deeper than ``max_depth``,
    that builds more than ``max_values`` containers, objects and memo entries or holds more than
    ``MAX_PICKLE_STACK`` values at once, that changes a container already inside another one (how
    a chain grows deeper than any stack shows) or an imported class, or that numbers its memo out
    of sequence. Why: CPython's C unpickler hashes a dict key or a set member recursively, so a
    10^6-deep tuple key overflows the C stack (SIGSEGV), and it sizes its memo by the largest index
    and its stack by the opcode count. The opcodes are read, never run; where this scan finds the
    pickle malformed (a value missing from a frame or the memo), CPython's unpickler refuses it too."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    try:
        _scan_pickle(raw, max_depth, max_values)
    except _Refused as e:
        raise error(f"{what}: refusing to unpickle {e}") from None
    except (IndexError, ValueError):  # malformed (a value missing from the stack or the memo)
        pass


class _Refused(Exception):
    pass


def _nest(children: list, state: int, max_depth: int) -> list:
    """The node of a new value holding ``children`` (which may change no more)."""
    return [_depth_holding(children, max_depth), state]


def _depth_holding(children: list, max_depth: int) -> int:
    depth = 0
    for child in children:
        if child[0] > depth:
            depth = child[0]
        if child[1] == _FREE:
            child[1] = _NESTED
    if depth >= max_depth:
        raise _Refused(f"values nested deeper than {max_depth} levels")
    return depth + 1


def _put_into(target: list, children: list, max_depth: int) -> None:
    """APPEND(S), SETITEM(S), ADDITEMS, BUILD: ``children`` go into ``target``."""
    if target[1] == _FREE:
        depth = _depth_holding(children, max_depth)
        if target[1] != _FREE:  # it was one of the children
            raise _Refused("a container that contains itself")
        if depth > target[0]:
            target[0] = depth
    elif target[1] == _NESTED:
        raise _Refused("a container changed after it was put inside another (pickle.dump never writes that)")
    elif target[1] == _IMPORTED:
        raise _Refused("a change to an imported class or function")


def _scan_pickle(raw: bytes | bytearray, max_depth: int, max_values: int) -> None:
    kinds, args = _KIND, _ARG
    atom, name, empty_tuple, nest = _ATOM, _NAME, _EMPTY_TUPLE_NODE, _nest
    stack: list = []
    marks: list[list] = []
    memo: list = []
    pos, end, built = 0, len(raw), 0
    while pos < end:
        # Limits are checked every 64 KiB of opcodes: nothing grows by more than that in between.
        stop = min(end, pos + 65536)
        while pos < stop:
            op = raw[pos]
            kind = kinds[op]
            pos += 1
            if kind == _MEMOIZE:
                memo.append(stack[-1])
            elif kind == _GET1:
                stack.append(memo[raw[pos]])
                pos += 1
            elif kind == _GET4:
                stack.append(memo[int.from_bytes(raw[pos:pos + 4], "little")])
                pos += 4
            elif kind == _ATOM_OP:
                pos += args[op]
                stack.append(atom)
            elif kind == _COUNTED:
                size = args[op]
                pos += size + int.from_bytes(raw[pos:pos + size], "little")
                stack.append(atom)
            elif kind == _TWO:  # TUPLE2, REDUCE, NEWOBJ, SETITEM
                children = stack[-2:]
                del stack[-2:]
                if len(children) < 2:
                    return
                if op == 0x73:  # SETITEM
                    _put_into(stack[-1], children, max_depth)
                else:
                    stack.append(nest(children, _FROZEN if op == 0x86 else _FREE, max_depth))
                    built += 1
            elif kind == _TUPLE1:
                stack[-1] = nest(stack[-1:], _FROZEN, max_depth)
                built += 1
            elif kind == _EMPTY_TUPLE:
                stack.append(empty_tuple)
            elif kind == _EMPTY:
                stack.append([1, _FREE])
                built += 1
            elif kind == _MARK:
                if len(marks) >= max_depth:
                    raise _Refused(f"values nested deeper than {max_depth} levels")
                marks.append(stack)
                stack = []
            elif kind == _INTO_MARK:  # APPENDS, SETITEMS, ADDITEMS
                children, stack = stack, marks.pop()
                _put_into(stack[-1], children, max_depth)
            elif kind == _INTO:  # APPEND, BUILD
                child = stack.pop()
                _put_into(stack[-1], [child], max_depth)
            elif kind == _FROM_MARK or kind == _THREE:  # TUPLE, LIST, DICT, FROZENSET, OBJ, INST; TUPLE3, NEWOBJ_EX
                if kind == _THREE:
                    if len(stack) < 3:
                        return
                    children = stack[-3:]
                    del stack[-3:]
                else:
                    children, stack = stack, marks.pop()
                if args[op]:  # INST: module and name lines
                    pos = _line_end(raw, _line_end(raw, pos) + 1) + 1
                stack.append(nest(children, _FROZEN if op in _FROZEN_RESULT else _FREE, max_depth))
                built += 1
            elif kind == _PUT or kind == _GET_LINE:
                size = args[op]
                if size > 0:
                    key = int.from_bytes(raw[pos:pos + size], "little")
                    pos += size
                else:
                    line_end = _line_end(raw, pos)
                    key = int(raw[pos:line_end].split(b"\0", 1)[0])  # CPython reads it as a C string
                    pos = line_end + 1
                if kind == _GET_LINE:
                    stack.append(memo[key])
                elif key == len(memo):
                    memo.append(stack[-1])
                elif 0 <= key < len(memo):
                    memo[key] = stack[-1]
                else:  # the C unpickler would size its memo by this index
                    raise _Refused(f"a memo index {key:,} out of sequence")
            elif kind == _LINE:
                pos = _line_end(raw, pos) + 1
                stack.append(atom)
            elif kind == _NAME_OP or kind == _STACK_GLOBAL:
                size = args[op]
                if size < 0:  # GLOBAL: module and name lines
                    pos = _line_end(raw, _line_end(raw, pos) + 1) + 1
                pos += max(size, 0)
                if kind == _STACK_GLOBAL:
                    del stack[-2:]
                stack.append(name)
            elif kind == _POP:  # on an empty frame it pops the MARK, as CPython's unpickler does
                if stack:
                    stack.pop()
                else:
                    stack = marks.pop()
            elif kind == _POP_MARK:
                stack = marks.pop()
            elif kind == _DUP:
                stack.append(stack[-1])
            elif kind == _PERSID:
                stack[-1] = atom
            elif kind == _NOTHING:
                pos += args[op]
            else:  # STOP, or not an opcode: the unpickler takes it from here
                end = stop = pos
        if len(stack) + sum(map(len, marks)) > MAX_PICKLE_STACK:
            raise _Refused(f"more than {MAX_PICKLE_STACK:,} values on its stack")
        if built + len(memo) > max_values:
            raise _Refused(f"more than {max_values:,} containers, objects and memo entries")


def _line_end(raw: bytes | bytearray, pos: int) -> int:
    """Where the line starting at ``pos`` ends (its newline, or the end of the data)."""
    found = raw.find(b"\n", pos)
    return len(raw) if found < 0 else found
