"""The prompts of an RL run: rows with a prompt and an answer, rendered for the model to answer, in a
shuffled order that a checkpoint resumes.

``rl.dataset`` is read as chat data is (``titanctl.data.chat_rows``: a file, a folder laid out like a
Hugging Face dataset, ``hf:``), or ``arithmetic``: the task titanctl ships, built by scripts/build_rl_task.py. A
row's ``rl.prompt_field`` is one user message (text) or a list of messages; it is rendered with the
tokenizer's chat template and its generation prompt (``titanctl.data.chat_encode``), and a completion
ends at the tokenizer's stop tokens or the template's end of turn. Every row must have an answer and be
a conversation the template takes: anything else is a one-line error naming the row, before the model is
built. A row is rendered when a step first samples it (rendering every row up front was most of the
start-up: two minutes for 100,000 rows); a rendered prompt that leaves no room for
``rl.max_response_tokens`` within training.seq_len stops the run at that step, in one line naming the
row, with every checkpoint written before it kept.

The order: epoch e is a permutation of the rows drawn from (training.seed, e); step s takes the next
rl.prompts_per_step prompts of it (an epoch's last step may reach into the next one). The loader's state is
the number of prompts taken, the same on every rank, so a resume continues exactly, under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanctl.config.job_config import RL
from titanctl.data.chat import chat_template_for, conversation_of
from titanctl.data.chat_encode import BadConversation, ChatEncoder
from titanctl.data.chat_rows import Unreadable, chat_files, read_rows
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import CheckpointError, DataError
from titanctl.safe_io import visible


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # the rendered prompt's tokens, generation prompt included
    text: str  # the prompt as the rewards see it: its last user message
    answer: str
    where: str  # file:line, for messages


@dataclass(frozen=True)
class _Row:
    """A row checked and read as a conversation, not yet rendered."""

    messages: list
    tools: list | None
    text: str
    answer: str
    where: str


class PromptSet:
    """Every row of ``cfg.dataset``'s split, checked up front and rendered when first sampled (``set[i]``: the
    chat template is most of the start-up, two minutes for 100,000 rows); ``stop_tokens``: where completions end."""

    def __init__(self, cfg: RL, tokenizer: Tokenizer, seq_len: int, chat_template_path: str = ""):
        files, self.description = chat_files(cfg.dataset, cfg.split)
        template = chat_template_for(tokenizer, chat_template_path)
        self._encoder = ChatEncoder(tokenizer, template)
        self._room, self._seq_len, self._max_response = seq_len - cfg.max_response_tokens, seq_len, \
            cfg.max_response_tokens
        self._rows: list[_Row] = []
        self._rendered: dict[int, Prompt] = {}
        turn_ends: dict[tuple, int | None] = {}  # by the conversation's roles and tools: what a template's
        # end of turn can depend on short of the text (7,000 probes were a third of the start-up)
        for row, where in read_rows(files):
            if isinstance(row, Unreadable):
                raise DataError(f"rl.dataset {self.description}: row {where} is not readable ({row.reason})")
            prompt = self._prompt(row, cfg, where)
            try:
                messages, tools = conversation_of({"messages": prompt, "tools": row.get("tools")}, to_answer=True)
                shape = (tuple(m["role"] for m in messages), bool(tools))
                if shape not in turn_ends:
                    turn_ends[shape] = self._encoder.turn_end_id(messages, tools)
            except BadConversation as e:
                raise self._unrendered(where, e) from None
            text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            self._rows.append(_Row(messages, tools, text, self._answer(row, cfg, where), where))
        if not self._rows:
            raise DataError(f"rl.dataset {self.description} has no rows")
        self.stop_tokens = sorted(set(tokenizer.stop_tokens) | {t for t in turn_ends.values() if t is not None})

    def __getitem__(self, index: int) -> Prompt:
        """Row ``index`` rendered (once): a one-line DataError if the template cannot render it or it leaves no
        room for rl.max_response_tokens."""
        if index not in self._rendered:
            row = self._rows[index]
            try:
                ids = tuple(int(i) for i in self._encoder.prompt_ids(row.messages, row.tools))
            except BadConversation as e:
                raise self._unrendered(row.where, e) from None
            if len(ids) > self._room:
                raise DataError(
                    f"rl.dataset {self.description}: row {row.where}'s prompt has {len(ids)} tokens, and "
                    f"rl.max_response_tokens = {self._max_response} more exceed training.seq_len = {self._seq_len}, "
                    f"the model's positions; raise training.seq_len or shorten the prompts or responses")
            self._rendered[index] = Prompt(ids, row.text, row.answer, row.where)
        return self._rendered[index]

    def _unrendered(self, where: str, e: BadConversation) -> DataError:
        why = f"a row {e.reason} {visible(e.detail)}".rstrip()  # a reason says what a row is
        return DataError(f"rl.dataset {self.description}: row {where} is no prompt the chat template renders: {why}")

    def _prompt(self, row, cfg: RL, where: str) -> list:
        if not isinstance(row, dict) or row.get(cfg.prompt_field) is None:
            raise DataError(f"rl.dataset {self.description}: row {where} has no {cfg.prompt_field!r} "
                            "(rl.prompt_field)")
        prompt = row[cfg.prompt_field]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            return prompt
        raise DataError(f"rl.dataset {self.description}: row {where}'s {cfg.prompt_field!r} is neither text nor a "
                        "list of messages")

    def _answer(self, row: dict, cfg: RL, where: str) -> str:
        answer = row.get(cfg.answer_field)
        if answer is None or isinstance(answer, (dict, list)):
            got = "none" if answer is None else type(answer).__name__
            raise DataError(f"rl.dataset {self.description}: row {where} has no {cfg.answer_field!r} answer "
                            f"(rl.answer_field; got {got}): every prompt needs the answer its rewards check")
        return str(answer)

    def __len__(self) -> int:
        return len(self._rows)


class PromptLoader:
    """The prompts of each step, in the order the module docstring describes; a checkpoint ``Stateful``
    (the ``dataloader`` part)."""

    def __init__(self, prompts: PromptSet, per_step: int, seed: int, group_size: int):
        self.prompts, self.per_step, self.seed = prompts, per_step, seed
        self.taken = 0
        self.global_batch_size = per_step * group_size  # sequences per update (recorded in checkpoints)
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.prompts), generator=gen).tolist()}
        return self._orders[epoch]

    def next_step(self) -> list[int]:
        """The row indices of the next step's prompts (global: every rank gets the same list)."""
        n = len(self.prompts)
        rows = [self._order(i // n)[i % n] for i in range(self.taken, self.taken + self.per_step)]
        self.taken += self.per_step
        return rows

    def state_dict(self) -> dict:
        return {"taken": self.taken, "rows": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        taken, rows = state.get("taken"), state.get("rows")
        if not isinstance(taken, int) or taken < 0:
            raise CheckpointError(f"dataloader state has taken {taken!r}, expected a count of prompts")
        if rows != len(self.prompts):
            raise CheckpointError(f"the checkpoint's prompts were {rows} rows, rl.dataset {self.prompts.description} "
                                  f"has {len(self.prompts)}: resume with the same prompts, or start a new dump folder")
        self.taken = taken
