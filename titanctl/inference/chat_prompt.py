"""The prompt of ``infer-tp --chat``: a conversation, rendered with the tokenizer's chat template.

``--prompt`` is a conversation when its text starts with ``[`` or ``{`` (after white space): JSON, a
list of OpenAI-style ``{"role", "content"}`` messages, or an object with ``messages`` and, optionally,
``tools``, as a row of chat data is (``titanctl.data.chat``: roles system, user, assistant and tool;
other keys, such as ``tool_calls``, go to the template as they are). Any other text is one user
message. The template is the tokenizer's own, or ``sft.chat_template_path`` (the recipe that trained
a model on chat data gives the template it was trained with).

The conversation is rendered with the template's generation prompt and tokenized as training
tokenizes a conversation (``titanctl.data.chat_encode``), so the ids equal transformers'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the template writes the
BOS where it has one, and none is added to it.

Generation stops at the tokenizer's stop tokens (its eos; Llama 3's end of text, turn and message;
Qwen's end of text and turn) and at the token the template ends an assistant turn with
(``ChatEncoder.turn_end_id``: the first special token the template writes after an assistant
message's content; Qwen3's ``<|im_end|>``, Llama 3.1's ``<|eot_id|>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanctl.data.chat import ROLES, chat_template_for, conversation_of
from titanctl.data.chat_encode import BadConversation, ChatEncoder
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import ConfigError
from titanctl.safe_io import parse_json, visible

_HINT = (f'give a JSON list of {{"role", "content"}} messages (roles {", ".join(ROLES)}), or text that does not '
         "start with [ or { for one user message")


@dataclass
class ChatPrompt:
    messages: list[dict]
    tools: list | None
    ids: list[int]  # the templated prompt's tokens
    text: str  # what they decode to: the templated prompt
    stop_tokens: set[int]
    template: str  # where the template came from

    def as_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "tools": self.tools, "template": self.template,
                "stop_tokens": sorted(self.stop_tokens)}


def chat_messages(prompt: str) -> tuple[list[dict], list | None]:
    """(messages, tools) that ``--prompt`` gives (see the module docstring); a ConfigError in one line
    when it is not a conversation."""
    if not prompt.lstrip().startswith(("[", "{")):
        return [{"role": "user", "content": prompt}], None
    try:
        value = parse_json(prompt, what="--prompt with --chat", error=ConfigError)
    except ConfigError as e:
        raise ConfigError(f"{e}; {_HINT}") from None
    try:
        return conversation_of({"messages": value} if isinstance(value, list) else value, to_answer=True)
    except BadConversation as e:
        what = f"a conversation {e.reason}"  # the reasons say what a row of chat data is
        detail = f" ({visible(e.detail)})" if e.detail else ""
        raise ConfigError(f"--prompt with --chat: {what}{detail}; {_HINT}") from None


def chat_prompt(messages: list[dict], tools: list | None, tokenizer: Tokenizer, template_path: str = "") -> ChatPrompt:
    """The conversation rendered and tokenized for the model to answer, with where to stop. A
    tokenizer without a template, or a template that refuses the conversation, is a one-line error."""
    template = chat_template_for(tokenizer, template_path)
    encoder = ChatEncoder(tokenizer, template)
    try:
        ids = [int(i) for i in encoder.prompt_ids(messages, tools)]
    except BadConversation as e:
        why = visible(e.detail or e.reason)
        raise ConfigError(
            f"--prompt with --chat: chat template {template.origin} refused the conversation: {why}"
        ) from None
    if not ids:
        raise ConfigError(f"--prompt with --chat: chat template {template.origin} rendered the conversation as no text")
    stops = set(tokenizer.stop_tokens)
    turn_end = encoder.turn_end_id(messages, tools)
    if turn_end is not None:
        stops.add(turn_end)
    return ChatPrompt(messages, tools, ids, tokenizer.decode(ids), stops, template.origin)
