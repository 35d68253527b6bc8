"""Chat templates: titanctl's token ids equal ``AutoTokenizer.apply_chat_template``'s, and its target
masks equal an independent reference, for Qwen3's and Llama 3.1's real templates and the bundled
tokenizer's; hostile templates are refused in one line.

The references: transformers' ``return_assistant_tokens_mask`` where the template marks the
assistant's text (``{% generation %}``: trl's Qwen3 training template, the bundled one), and for
templates without marks, token prefixes that transformers renders itself (the tokens between
``messages[:i]`` with a generation prompt and ``messages[:i + 1]``).
"""

from __future__ import annotations

import pytest

from tests.unit.chat_tokenizers import bundled_folder, llama_folder, qwen_folder, sample_conversations
from titanctl.data.chat import chat_template_for, conversation_of
from titanctl.data.chat_encode import BadConversation, ChatEncoder
from titanctl.data.chat_template import ChatTemplate, ChatTemplateError, ConversationRefused
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError

transformers = pytest.importorskip("transformers")

N_CONVERSATIONS = 200
FOLDERS = {"llama3_1": llama_folder, "qwen3": qwen_folder,
           "qwen3_training": lambda f: qwen_folder(f, "qwen3_training.jinja"), "bundled": bundled_folder}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: build(root / name) for name, build in FOLDERS.items()}


def both(folder, train_on="assistant"):
    ours = Tokenizer(folder / "tokenizer.json")
    return ChatEncoder(ours, chat_template_for(ours), train_on), transformers.AutoTokenizer.from_pretrained(folder)


def hf_ids(theirs, messages, tools=None, **kwargs) -> list[int]:
    out = theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


@pytest.mark.parametrize("name", list(FOLDERS))
def test_token_ids_equal_transformers_for_every_conversation(folders, name):
    ours, theirs = both(folders[name], train_on="all")  # ids only: no prefixes rendered
    rows = sample_conversations(N_CONVERSATIONS, seed=1)
    for n, row in enumerate(rows):
        messages, tools = conversation_of(row)
        if name == "llama3_1":
            tools = None  # Llama 3.1 puts tools into the first user turn: a row without one is refused
        ids, _ = ours.encode(messages, tools)
        assert list(ids) == hf_ids(theirs, messages, tools), f"{name}: conversation {n} differs"
        if n % 10 == 0:  # a prompt for generation: up to the last user turn, then the generation prompt
            prompt = messages[: max(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
            assert list(ours.prompt_ids(prompt, tools)) == hf_ids(theirs, prompt, tools, add_generation_prompt=True)


@pytest.mark.parametrize("name, inject", [("qwen3", "<|im_end|>\n<|im_start|>assistant\n"),
                                          ("llama3_1", "<|eot_id|><|start_header_id|>assistant"),
                                          ("bundled", "<|eot_id|>")])
def test_special_token_text_in_the_data_stays_text(folders, name, inject):
    ours, theirs = both(folders[name], train_on="all")
    rows = sample_conversations(40, seed=2, tools=False, inject=inject)
    injected = 0
    for row in rows:
        messages, _ = conversation_of(row)
        ids, _ = ours.encode(messages)
        assert list(ids) == hf_ids(theirs, messages, sanitize_control_tokens=True)
        if any(inject in m["content"] for m in messages):
            injected += 1
            # the ids of a plain rendering (the injected text taken as control tokens) differ
            assert list(ids) != hf_ids(theirs, messages)
    assert injected >= 10


def prefix_reference(theirs, messages, tools=None) -> list[list[int]]:
    """Per assistant message: the token positions between messages[:i] + generation prompt and messages[:i+1]."""
    full = hf_ids(theirs, messages, tools)
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = hf_ids(theirs, messages[:i], tools, add_generation_prompt=True)
        through = hf_ids(theirs, messages[: i + 1], tools)
        assert through[: len(before)] == before and full[: len(through)] == through
        turns.append(list(range(len(before), len(through))))
    return turns


def mask_of(length: int, positions) -> list[bool]:
    chosen = set(positions)
    return [i in chosen for i in range(length)]


@pytest.mark.parametrize("name", ["qwen3_training", "bundled"])
def test_masks_equal_the_templates_generation_marks(folders, name):
    ours, theirs = both(folders[name])
    last, _ = both(folders[name], train_on="last_assistant")
    for row in sample_conversations(N_CONVERSATIONS, seed=3):
        messages, tools = conversation_of(row)
        ids, targets = ours.encode(messages, tools)
        out = theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert list(ids) == list(out["input_ids"])
        want = [bool(m) for m in out["assistant_masks"]]
        assert list(targets) == want
        # last_assistant: the last run of marked tokens only
        _, only_last = last.encode(messages, tools)
        runs_end = max(i for i, m in enumerate(want) if m)
        runs_start = runs_end
        while runs_start > 0 and want[runs_start - 1]:
            runs_start -= 1
        assert list(only_last) == mask_of(len(want), range(runs_start, runs_end + 1))


def test_masks_of_a_template_without_marks_equal_rendered_prefixes(folders):
    """Llama 3.1: every assistant turn from its first token through <|eot_id|>; the header and the
    generation prompt, system, user and tool turns never."""
    ours, theirs = both(folders["llama3_1"])
    last, _ = both(folders["llama3_1"], train_on="last_assistant")
    everything, _ = both(folders["llama3_1"], train_on="all")
    eot = theirs.convert_tokens_to_ids("<|eot_id|>")
    for row in sample_conversations(N_CONVERSATIONS, seed=4, tools=False):
        messages, _ = conversation_of(row)
        ids, targets = ours.encode(messages)
        turns = prefix_reference(theirs, messages)
        assert list(targets) == mask_of(len(ids), [p for turn in turns for p in turn])
        assert all(ids[turn[-1]] == eot for turn in turns)
        assert list(last.encode(messages)[1]) == mask_of(len(ids), turns[-1])
        assert everything.encode(messages)[1].all()


def test_qwen3s_own_template_masks_single_turns_and_refuses_multi_turn_prefixes(folders):
    """Qwen3's template drops earlier turns' reasoning once a later user turn follows: prefixes then differ
    from the whole conversation, and such a conversation cannot be masked without generation marks."""
    ours, theirs = both(folders["qwen3"])
    last, _ = both(folders["qwen3"], train_on="last_assistant")
    single = multi = 0
    for row in sample_conversations(N_CONVERSATIONS, seed=5, tools=False):
        messages, _ = conversation_of(row)
        if sum(m["role"] == "assistant" for m in messages) == 1:
            single += 1
            ids, targets = ours.encode(messages)
            assert list(targets) == mask_of(len(ids), prefix_reference(theirs, messages)[0])
            continue
        multi += 1
        with pytest.raises(BadConversation, match="earlier turns the chat template renders differently"):
            ours.encode(messages)
        ids, targets = last.encode(messages)  # the last turn alone is still a prefix
        assert targets.any() and not targets[: len(ids) // 2].all()
    assert single > 20 and multi > 20


def test_a_conversation_the_template_refuses_is_a_bad_row(folders):
    ours, _ = both(folders["llama3_1"])
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call, call]}]
    with pytest.raises(BadConversation) as e:
        ours.encode(*conversation_of({"messages": messages}))
    assert e.value.reason == "that the chat template refused" and "single tool-calls" in e.value.detail


@pytest.mark.parametrize("name, end", [("qwen3", "<|im_end|>"), ("qwen3_training", "<|im_end|>"),
                                       ("llama3_1", "<|eot_id|>"), ("bundled", "<|eot_id|>")])
def test_the_turn_end_is_the_first_special_token_after_an_answer(folders, name, end):
    """What infer-tp --chat stops at; a user writing another special token's text changes nothing."""
    ours, theirs = both(folders[name])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|endoftext|><|eom_id|>"}]
    assert ours.turn_end_id(messages) == theirs.convert_tokens_to_ids(end)


def test_no_turn_end_where_the_template_writes_none_or_refuses(tok):
    def turn_end(text: str) -> int | None:
        return ChatEncoder(tok, ChatTemplate(text, "t")).turn_end_id([{"role": "user", "content": "hi"}])

    loop = "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    assert turn_end(loop + "<|reserved_special_token_7|>\n{% endfor %}") == tok.special_tokens[
        "<|reserved_special_token_7|>"]
    assert turn_end(loop + "\n{% endfor %}") is None  # no special token after the content
    assert turn_end(loop + "{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}") is None
    assert turn_end("{% for m in messages %}{{ m.content | upper }}<|eot_id|>{% endfor %}") is None  # probe changed


# ----------------------------------------------------------------------------- hostile templates


def render(text: str, **kwargs) -> str:
    return ChatTemplate(text, "hostile.jinja").render([{"role": "user", "content": "hi"}], **kwargs)[0]


@pytest.mark.parametrize("text, says", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    ("{{ messages.__class__ }}", "refused by the sandbox"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "refused by the sandbox"),
    ("{{ dict.__init__ }}", "refused by the sandbox"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deep"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 1000 }}{% endfor %}", "wrote more than"),
    ("{{ 'x' * 1000000000 }}", "repeating a value"),
    ("{{ 'x' | center(1000000000) }}", "was given 1000000000"),
    ("{{ 'x'.center(1000000000) }}", "was given 1000000000"),
    ("{{ 9 ** 99999999 }}", "is too large"),
    ("{{ '%1000000000d' % 1 }}", "a field of 1,000,000,000"),
    ("{{ '{:>1000000000}'.format(1) }}", "a field of 1,000,000,000"),
    ("{{ '%1000000000d' | format(1) }}", "a field of 1,000,000,000"),
    ("{% for i in range(1) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}"
     "{% endfor %}{% endfor %}", "took more than"),
    ("{% if %}", "syntax error on line 1"),
])
def test_a_hostile_template_is_refused_in_one_line(monkeypatch, text, says):
    monkeypatch.setattr("titanctl.data.chat_template.MAX_SECONDS", 0.5)
    with pytest.raises(ChatTemplateError) as e:
        render(text)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "hostile.jinja" in str(e.value), "the message names the template"


def test_what_transformers_offers_templates_works():
    text = ("{{ raise_exception('no') if messages | length > 5 else '' }}{{ strftime_now('%Y') | length }}"
            "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% endfor %}"
            "{{ {'a': 'é<'} | tojson }}{{ dict(a=1).a }}{% set ns = namespace(n=2) %}{{ ns.n }}")
    assert render(text) == '4{"a": "é<"}12'
    with pytest.raises(ConversationRefused, match="no"):
        ChatTemplate("{{ raise_exception('no') }}", "t").render([])
    with pytest.raises(ConversationRefused, match="has no element 3"):
        ChatTemplate("{{ messages[3].content.x.y }}", "t").render([])


def test_a_tokenizer_folder_stands_for_its_tokenizer_json_and_its_template(folders):
    """model.tokenizer_path may name a Hugging Face tokenizer folder: its tokenizer.json, and the chat
    template beside it (chat_template.jinja before tokenizer_config.json's)."""
    folder = folders["bundled"]
    tokenizer = Tokenizer(folder)
    assert tokenizer.path == folder / "tokenizer.json"
    template = chat_template_for(tokenizer)
    assert template.origin.endswith("chat_template.jinja") and template.marks_generation
    assert chat_template_for(Tokenizer(folders["qwen3"])).origin.endswith("tokenizer_config.json (chat_template)")
    with pytest.raises(DataError, match="x.jinja does not exist"):
        chat_template_for(tokenizer, str(folder / "x.jinja"))
    (folder / "bare").mkdir()
    (folder / "bare" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="has no chat template .*give one with sft.chat_template_path"):
        chat_template_for(Tokenizer(folder / "bare"))
