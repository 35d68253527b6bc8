"""Chat fine-tuning data: ``training.dataset = "chat:<file, folder or hf:id>"``.

A row is a conversation: OpenAI-style ``messages`` (a list of ``{"role", "content"}`` objects, roles
system, user, assistant and tool, any number of turns; other keys such as ``tool_calls`` or
``reasoning_content`` are passed to the template as they are), with an optional ``tools`` list; or
a ``prompt`` and a ``completion`` (strings, which become a user and an assistant message, or lists
of messages), which become the messages prompt + completion.

A row that cannot be a training conversation is skipped and counted, never a crash: no assistant
turn, an unknown role, content that is not a string (an assistant turn with ``tool_calls`` may have
none), a value that is not plain JSON, a row the template refuses, or one with nothing to learn. A
conversation longer than seq_len tokens is cut to its first seq_len tokens (``sft.overlong =
truncate``; dropped if nothing to learn is left) or dropped (``drop``). A dataset with no usable
conversation is a one-line DataError. What was skipped is said in one line when training starts.

Each conversation is rendered with the tokenizer's chat template and tokenized (chat_encode.py),
then all of them are packed into windows (chat_pack.py). The windows depend only on the files, the
tokenizer, the template, the sft settings and seq_len: the same on every rank and layout, so the
loader shuffles, mixes, shards and resumes them as it does pre-training windows. They are cached
as .npy files beside the loader's token cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from titanctl.data.cache import cache_dir
from titanctl.data.chat_encode import TRAIN_ON, BadConversation, ChatEncoder
from titanctl.data.chat_pack import WINDOW_ROWS, pack_windows
from titanctl.data.chat_rows import Unreadable, chat_files, read_rows
from titanctl.data.chat_template import ChatTemplate, find_chat_template, special_token_texts
from titanctl.data.local_files import fingerprint
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError, counted
from titanctl.safe_io import visible

CHAT_PREFIX = "chat:"
# One conversation's bounds, checked before it is rendered (a row past them is skipped and counted):
MAX_MESSAGES = 1024  # messages of one conversation: the longest chats of public sets have a few hundred
MAX_CONVERSATION_CHARS = 1 << 21  # characters of its text (2 Mi: ~500k tokens, past any seq_len)
ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")
_CACHE_FORMAT = "titanctl-chat-windows-v1"  # bump when rendering, masking or packing changes


def is_chat(name: str) -> bool:
    return name.startswith(CHAT_PREFIX)


@dataclasses.dataclass
class ChatReport:
    """What became of a chat dataset's rows."""

    description: str
    seq_len: int
    rows: int = 0
    used: int = 0
    truncated: int = 0
    too_long: int = 0  # dropped for their length
    windows: int = 0
    tokens: int = 0  # of the used conversations, in the windows
    targets: int = 0  # tokens the loss learns
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> rows
    first: dict[str, str] = dataclasses.field(default_factory=dict)  # reason -> the first such row (and why)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        """Count a skipped row; ``reason`` says what the row is, after the word "row" ("without an
        assistant turn"), so that ``counted`` can say "1 row ..." and "2 rows ..." alike."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first.setdefault(reason, where + (f": {visible(detail)[:120]}" if detail else ""))

    def _skips(self) -> list[str]:
        return [f"{counted(n, 'row')} {reason} (first: {self.first[reason]})" for reason, n in self.skipped.items()]

    def summary(self) -> str:
        fill = self.tokens / max(1, self.windows * self.seq_len)
        parts = [f"chat data {self.description}: {self.used:,} of {counted(self.rows, 'conversation')} in "
                 f"{counted(self.windows, 'window')} of {self.seq_len} tokens ({fill:.0%} filled), "
                 f"{self.targets:,} tokens learned"]
        if self.truncated:
            parts.append(f"{self.truncated:,} cut to seq_len")
        if self.too_long:
            parts.append(f"{self.too_long:,} longer than seq_len dropped (sft.overlong)")
        if self.skipped:
            parts.append(f"skipped {counted(sum(self.skipped.values()), 'row')}: {'; '.join(self._skips())}")
        return "; ".join(parts)

    def nothing_usable(self) -> DataError:
        why = self._skips()
        if self.too_long:
            why.append(f"{counted(self.too_long, 'conversation')} longer than seq_len {self.seq_len} "
                       "(sft.overlong = drop)")
        return DataError(f"chat dataset {self.description} has no usable conversation among "
                         f"{counted(self.rows, 'row')}: {'; '.join(why) or 'no rows'}")


class ChatSource:
    """A chat dataset's files and the settings that turn them into windows. Finite."""

    name = "chat"
    streaming = False
    chat = True

    def __init__(self, target: str, *, split: str = "train", train_on: str = "assistant",
                 overlong: str = "drop", chat_template_path: str = "") -> None:
        if train_on not in TRAIN_ON or overlong not in OVERLONG:
            raise DataError(f"sft.train_on {train_on!r} / sft.overlong {overlong!r}: choose from {TRAIN_ON} / "
                            f"{OVERLONG}")
        self.target, self.split = target, split
        self.train_on, self.overlong, self.chat_template_path = train_on, overlong, chat_template_path
        self.files, self.description = chat_files(target, split)
        settings = f"{train_on}:{overlong}"
        content = fingerprint(self.files, "chat dataset file")
        self.fingerprint = hashlib.sha256(f"{content}:{settings}".encode()).hexdigest()
        self.report: ChatReport | None = None  # after windows()
        self.template_sha256: str | None = None

    def __repr__(self) -> str:
        return f"ChatSource({self.description!r})"

    def windows(self, tokenizer: Tokenizer, seq_len: int) -> np.ndarray:
        """(n, WINDOW_ROWS, seq_len) int32 windows of the dataset (cached); sets ``report``."""
        template = chat_template_for(tokenizer, self.chat_template_path)
        self.template_sha256 = template.sha256
        cache = _cache_files(self, tokenizer, template, seq_len)
        if cache is not None:
            loaded = _load_cached(*cache, seq_len)
            if loaded is not None:
                # the same files' content, maybe under another path: said as given now
                self.report = dataclasses.replace(ChatReport(**loaded[1]), description=self.description)
                return loaded[0]
        windows, self.report = build_windows(self, ChatEncoder(tokenizer, template, self.train_on), seq_len,
                                             tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id)
        if cache is not None:
            _save_cached(*cache, windows, dataclasses.asdict(self.report))
        return windows


def chat_template_for(tokenizer: Tokenizer, path: str = "") -> ChatTemplate:
    """The chat template of ``tokenizer`` (or the file ``path``), with the special tokens it may name."""
    text, origin = find_chat_template(tokenizer.path, path)
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    return ChatTemplate(text, visible(origin), special_token_texts(tokenizer.path, ids, names))


def build_windows(source: ChatSource, encoder: ChatEncoder, seq_len: int, pad_id: int) -> tuple[np.ndarray, ChatReport]:
    report = ChatReport(source.description, seq_len)
    conversations = []
    for row, where in read_rows(source.files):
        report.rows += 1
        if isinstance(row, Unreadable):
            report.skip(row.reason, where)
            continue
        try:
            messages, tools = conversation_of(row)
            ids, targets = encoder.encode(messages, tools)
        except BadConversation as e:
            report.skip(e.reason, where, e.detail)
            continue
        if len(ids) > seq_len:
            if source.overlong == "drop":
                report.too_long += 1
                continue
            ids, targets = ids[:seq_len], targets[:seq_len]
            if not targets[1:].any():
                report.skip("with nothing to learn within seq_len tokens", where)
                continue
            report.truncated += 1
        elif not targets[1:].any():
            report.skip("with nothing to learn", where)
            continue
        conversations.append((ids, targets))
        report.used += 1
        report.tokens += len(ids)
        report.targets += int(targets[1:].sum())
    if not conversations:
        raise report.nothing_usable()
    windows = pack_windows(conversations, seq_len, pad_id)
    report.windows = len(windows)
    return windows, report


def conversation_of(row: Any, *, to_answer: bool = False) -> tuple[list[dict], list | None]:
    """(messages, tools) of a row; raises BadConversation. ``to_answer``: a conversation for a model to
    answer (infer-tp --chat), which needs no assistant turn."""
    if not isinstance(row, dict):
        raise BadConversation("not a JSON object")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadConversation("with tools that are not a list")
    if row.get("messages") is not None:
        messages = row["messages"]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        messages = _as_messages(row["prompt"], "user") + _as_messages(row["completion"], "assistant")
    else:
        raise BadConversation("without messages (or prompt and completion)")
    if not isinstance(messages, list) or not messages:
        raise BadConversation("with messages that are not a list of messages")
    if len(messages) > MAX_MESSAGES:
        raise BadConversation(f"with more than {MAX_MESSAGES:,} messages", f"{len(messages):,} messages")
    clean = []
    for message in messages:
        if not isinstance(message, dict):
            raise BadConversation("with a message that is not a JSON object")
        message = {k: v for k, v in message.items() if v is not None}  # as transformers drops them
        role = message.get("role")
        if role not in ROLES:
            raise BadConversation("with an unknown role", f"role {str(role)[:40]!r}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and role == "assistant" and message.get("tool_calls")):
            raise BadConversation("with content that is not a string", f"{role} content {type(content).__name__}")
        clean.append(message)
    if not to_answer and not any(m["role"] == "assistant" for m in clean):
        raise BadConversation("without an assistant turn")
    chars = _plain_chars([clean, tools])
    if chars is None:
        raise BadConversation("holding values that are not plain JSON text")
    if chars > MAX_CONVERSATION_CHARS:
        raise BadConversation(f"with more than {MAX_CONVERSATION_CHARS:,} characters", f"{chars:,} characters")
    return clean, tools


def _as_messages(value: Any, role: str) -> list:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise BadConversation("with a prompt or completion that is neither text nor a list of messages")


def _plain_chars(value: Any) -> int | None:
    """The characters of the strings of ``value`` if it is JSON data only (what the sandboxed template
    may touch) with text that is valid Unicode; else None."""
    stack, chars = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate from a JSON escape
                return None
        elif isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return None
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif item is not None and type(item) not in (int, float, bool):
            return None
    return chars


# ----------------------------------------------------------------------------- cache


def _cache_files(source: ChatSource, tokenizer: Tokenizer, template: ChatTemplate, seq_len: int):
    root = cache_dir()
    if root is None:
        return None
    key = hashlib.sha256(
        f"{_CACHE_FORMAT}:{tokenizer.sha256}:{template.sha256}:{source.fingerprint}:{seq_len}".encode()
    ).hexdigest()[:32]
    folder = root / "chat"
    return folder / f"{key}.npy", folder / f"{key}.json"


def _load_cached(windows_file: Path, report_file: Path, seq_len: int) -> tuple[np.ndarray, dict] | None:
    try:
        report = json.loads(report_file.read_text())
        windows = np.load(windows_file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    fields = {f.name for f in dataclasses.fields(ChatReport)}
    if not isinstance(report, dict) or set(report) != fields or windows.shape[1:] != (WINDOW_ROWS, seq_len):
        return None
    return windows, report


def _save_cached(windows_file: Path, report_file: Path, windows: np.ndarray, report: dict) -> None:
    """Windows first, then the report that marks them complete; each written whole and renamed."""
    try:
        windows_file.parent.mkdir(parents=True, exist_ok=True)
        for path, write in ((windows_file, lambda f: np.save(f, windows, allow_pickle=False)),
                            (report_file, lambda f: f.write(json.dumps(report).encode()))):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError:
        pass  # a read-only cache only costs building the windows again
