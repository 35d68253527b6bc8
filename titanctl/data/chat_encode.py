"""One conversation -> its token ids and which of them the loss learns (the target mask).

Token ids equal ``AutoTokenizer.apply_chat_template(messages, tokenize=True)``'s for the same
tokenizer and template: the template's text is cut at the tokenizer's special tokens, each one id,
and the text between them is encoded as ordinary text. Special-token text inside the conversation
(a user writing ``<|im_end|>``) is never a control token: before rendering it is wrapped in two
private-use marker characters, and after rendering each marked token is encoded as plain text and
the markers dropped (what ``apply_chat_template(..., sanitize_control_tokens=True)`` does). So data
cannot forge a turn.

Which tokens are targets (``sft.train_on``):
- ``assistant``: every assistant turn, its end-of-turn token included. Where the template marks
  them (``{% generation %}``), the marked text; otherwise by rendering prefixes: for assistant
  message i, the text between ``render(messages[:i], add_generation_prompt=True)`` and
  ``render(messages[:i + 1])``, which must both be prefixes of the whole rendering (a template that
  renders earlier turns differently once later ones follow, such as Qwen3's own, cannot be cut so:
  such a conversation is refused and counted);
- ``last_assistant``: the last of those turns only;
- ``all``: every token.
A token that overlaps a target span is a target (as transformers' assistant mask counts it). The
loss learns token t from position t - 1: the first token is never learned.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np

from titanctl.data.chat_template import ChatTemplate, ConversationRefused
from titanctl.data.tokenizer import Tokenizer

TRAIN_ON = ("assistant", "last_assistant", "all")
MAX_ROW_RENDER_CHARS = 64 << 20  # all renderings of one conversation: a 32k-token one with 50 answers needs 7 Mi
MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # private-use: never in a tokenizer's vocabulary as a whole


class BadConversation(Exception):
    """A row that cannot become a training conversation; ``args[0]`` is the reason counted."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class ChatEncoder:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, train_on: str = "assistant") -> None:
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on
        self.special_ids = dict(tokenizer.special_tokens)
        alternatives = "|".join(map(re.escape, sorted(self.special_ids, key=len, reverse=True))) or "(?!)"
        self._special = re.compile(alternatives)
        self._marked = re.compile(f"{MARK_START}({alternatives}){MARK_END}|[{MARK_START}{MARK_END}]")
        self._rendered = 0  # characters rendered for the conversation being encoded
        self._byte_lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
        for token, rank in tokenizer.ranks.items():
            self._byte_lengths[rank] = len(token)
        for text, rank in self.special_ids.items():
            self._byte_lengths[rank] = len(text.encode())

    def encode(self, messages: list[dict], tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(token ids (L,) int32, target mask (L,) bool). Raises BadConversation."""
        messages, tools = self.mark(messages), self.mark(tools)
        self._rendered = 0
        text, generated = self._render(messages, tools=tools)
        spans = self._target_spans(messages, tools, text, generated)
        ids, starts, ends = self.tokenize(text)
        targets = np.zeros(len(ids), dtype=bool)
        for first, last in spans:  # [first, last) characters
            targets |= (starts < last) & (ends > first)
        return ids, targets

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> np.ndarray:
        """The ids of a conversation and then the template's generation prompt, for a model to answer
        (``apply_chat_template(..., add_generation_prompt=True)``'s). Raises BadConversation."""
        self._rendered = 0
        text, _ = self._render(self.mark(messages), tools=self.mark(tools), add_generation_prompt=True)
        return self.tokenize(text)[0]

    def turn_end_id(self, messages: list[dict], tools: list | None = None) -> int | None:
        """The token that ends the assistant turn which ``prompt_ids(messages, tools)`` opens, as the
        template writes it: ``messages`` plus an assistant message of probe text are rendered, and the
        first special token after the probe is the turn's end (Qwen3: ``<|im_end|>``, Llama 3.1 and
        the bundled template: ``<|eot_id|>``). None when the template refuses that conversation,
        changes the probe text, or writes no special token after it."""
        probe = "titanctl turn-end probe"  # plain words: a template that trims or escapes content keeps them
        answered = [*self.mark(messages), {"role": "assistant", "content": probe}]
        self._rendered = 0
        try:
            text, _ = self._render(answered, tools=self.mark(tools))
            at = text.rfind(probe)
            # tokenized, so that special-token text the conversation wrote is not taken for one
            after = self.tokenize(text[at + len(probe):])[0] if at >= 0 else ()
        except BadConversation:
            return None
        specials = set(self.special_ids.values())
        return next((int(i) for i in after if i in specials), None)

    def mark(self, value: Any) -> Any:
        """``value`` with every special-token text in its strings wrapped in markers (markers already
        there dropped; NFC-normalized first when the tokenizer normalizes)."""
        if isinstance(value, str):
            if self.tokenizer.nfc:
                value = unicodedata.normalize("NFC", value)
            value = value.replace(MARK_START, "").replace(MARK_END, "")
            return self._special.sub(lambda m: f"{MARK_START}{m.group(0)}{MARK_END}", value)
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        return value

    def tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids (L,) int32, each token's first character (L,), one past its last character (L,)) of a
        rendered text holding marked special-token text."""
        ids: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        ends: list[np.ndarray] = []

        def emit(piece: str, offset: int, plain: bool) -> None:
            if not piece:
                return
            if plain:
                self._ordinary(piece, offset, ids, starts, ends)
                return
            done = 0
            for m in self._special.finditer(piece):
                self._ordinary(piece[done:m.start()], offset + done, ids, starts, ends)
                ids.append(np.array([self.special_ids[m.group(0)]], dtype=np.int32))
                starts.append(np.array([offset + m.start()]))
                ends.append(np.array([offset + m.end()]))
                done = m.end()
            self._ordinary(piece[done:], offset + done, ids, starts, ends)

        done = 0
        for m in self._marked.finditer(text):
            emit(text[done:m.start()], done, plain=False)
            if m.group(1) is not None:  # special-token text from the conversation: plain text
                emit(m.group(1), m.start(1), plain=True)
            done = m.end()  # a lone marker is dropped, but still splits the text around it
        emit(text[done:], done, plain=False)
        if not ids:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(ids), np.concatenate(starts), np.concatenate(ends)

    def _ordinary(self, piece: str, offset: int, ids: list, starts: list, ends: list) -> None:
        if not piece:
            return
        encoded = np.asarray(self.tokenizer.encode(piece, bos=False, eos=False), dtype=np.int32)
        char_bytes = _utf8_lengths(piece)
        token_ends = np.cumsum(self._byte_lengths[encoded])
        if token_ends[-1] != char_bytes.sum():  # NFC changed the text the template wrote
            raise BadConversation("with text that the tokenizer's NFC normalization changes")
        byte_to_char = np.repeat(np.arange(len(piece)), char_bytes)  # the character of each byte
        ids.append(encoded)
        starts.append(offset + byte_to_char[token_ends - self._byte_lengths[encoded]])
        ends.append(offset + byte_to_char[token_ends - 1] + 1)

    def _render(self, messages: list[dict], **kwargs) -> tuple[str, list[tuple[int, int]]]:
        try:
            text, spans = self.template.render(messages, **kwargs)
        except ConversationRefused as e:
            raise BadConversation("that the chat template refused", str(e)) from None
        # Without generation marks a conversation is rendered twice per assistant turn, each time its
        # prefix: quadratic in its turns. The characters of all its renderings together are bounded.
        self._rendered += len(text)
        if self._rendered > MAX_ROW_RENDER_CHARS:
            raise BadConversation(f"whose renderings (two per assistant turn without {{% generation %}} marks) "
                                  f"exceed {MAX_ROW_RENDER_CHARS:,} characters together")
        return text, spans

    def _target_spans(self, messages, tools, text: str, generated: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if self.train_on == "all":
            return [(0, len(text))]
        if self.template.marks_generation:
            if not generated:
                raise BadConversation("in which the chat template marks no assistant text")
            return generated[-1:] if self.train_on == "last_assistant" else generated
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.train_on == "last_assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before, _ = self._render(messages[:i], tools=tools, add_generation_prompt=True)
            through, _ = self._render(messages[: i + 1], tools=tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise BadConversation(
                    "whose earlier turns the chat template renders differently once later turns follow, so its "
                    "assistant turns cannot be found by rendering prefixes"
                )
            spans.append((len(before), len(through)))
        return spans


def _utf8_lengths(text: str) -> np.ndarray:
    """UTF-8 bytes of each character of ``text``."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
