"""`titanctl infer-tp --chat`: the prompt is a conversation rendered with the tokenizer's chat template
(ids equal to transformers' apply_chat_template), generation stops at the template's end of turn, and
a prompt or template that cannot make a chat prompt is one line, exit code 2, before the model is
loaded. Greedy tokens equal transformers' generate(): tests/unit/inference/test_generate_parity.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import titanctl.inference.generate as generation
from tests.unit.chat_tokenizers import bundled_folder, qwen_folder
from titanctl.checkpoint.trust.metadata import write_metadata
from titanctl.cli.app import main
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import ConfigError
from titanctl.inference.chat_prompt import chat_messages, chat_prompt
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.weight_init import initialize_weights

ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=4352, multiple_of=32, max_seq_len=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama in a DCP folder, for the bundled tokenizer (its chat template beside it)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("chat_ckpt")
    assert ARGS.vocab_size == Tokenizer().vocab_size
    model = Transformer(ARGS)
    initialize_weights(model, seed=3)
    dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(folder), no_dist=True)
    write_metadata(folder, ARGS, step=1, weights_only=True, dtype="float32")
    return folder


@pytest.fixture(scope="module", autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run() sizes torch's pool for its one process


def test_a_plain_prompt_is_one_user_message_and_json_is_a_conversation():
    assert chat_messages("Hello [there]") == ([{"role": "user", "content": "Hello [there]"}], None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": None}]
    assert chat_messages(json.dumps(messages)) == ([messages[0], {"role": "user", "content": "hi"}], None)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat_messages(" \n" + json.dumps({"messages": messages, "tools": tools}))[1] == tools


@pytest.mark.parametrize("prompt", ["Hello there", json.dumps([{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "<|eot_id|>hi"}])])
def test_the_chat_prompt_is_apply_chat_templates(tmp_path, prompt):
    """No BOS is added: the template writes it (the tokens are apply_chat_template(tokenize=True)'s)."""
    transformers = pytest.importorskip("transformers")
    folder = bundled_folder(tmp_path / "bundled")
    tokenizer = Tokenizer(folder)
    messages, tools = chat_messages(prompt)
    chat = chat_prompt(messages, tools, tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      sanitize_control_tokens=True)["input_ids"]
    assert chat.ids == list(want) and chat.ids.count(tokenizer.bos_id) == 1
    assert chat.text == theirs.decode(want) and chat.text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat.stop_tokens == tokenizer.stop_tokens  # Llama 3's end of turn is one of them already


def test_the_templates_end_of_turn_is_a_stop_token(tmp_path):
    """Qwen's tokenizer stops at <|im_end|> anyway; a template (sft.chat_template_path) that ends turns
    with another token adds it."""
    tokenizer = Tokenizer(qwen_folder(tmp_path / "qwen"))
    messages, _ = chat_messages("hi")
    assert tokenizer.special_tokens["<|im_end|>"] in chat_prompt(messages, None, tokenizer).stop_tokens
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}<tool_call>\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    chat = chat_prompt(messages, None, tokenizer, str(template))
    assert chat.stop_tokens == tokenizer.stop_tokens | {tokenizer.special_tokens["<tool_call>"]}
    assert chat.text == "user: hi<tool_call>\nassistant: "


def test_infer_tp_chat_answers_and_reports_the_templated_prompt(checkpoint, tmp_path, capsys):
    out = tmp_path / "out.json"
    messages = [{"role": "user", "content": "say \x1b[31mred"}]
    with pytest.raises(SystemExit) as exc:
        main(["infer-tp", "--checkpoint", str(checkpoint), "--chat", "--prompt", json.dumps(messages),
              "--temperature", "0", "--max-new-tokens", "4", "--out", str(out)])
    assert exc.value.code == 0
    data = json.loads(out.read_text())
    tokenizer = Tokenizer()
    chat = chat_prompt(messages, None, tokenizer)
    assert data["prompt_tokens"] == chat.ids and data["prompt"] == chat.text
    assert data["chat"] == {"messages": messages, "tools": None, "template": str(DEFAULT_TOKENIZER_PATH.parent /
                                                                                "chat_template.jinja"),
                            "stop_tokens": sorted(tokenizer.stop_tokens)}
    shown = capsys.readouterr().out
    assert "<|start_header_id|>user<|end_header_id|>" in shown and "say \\x1b[31mred" in shown  # not obeyed
    assert "\x1b[31m" not in shown


@pytest.fixture
def no_model_load(monkeypatch):
    def loaded(*a, **kw):
        raise AssertionError("loaded the model")

    monkeypatch.setattr(generation, "load_model", loaded)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("prompt, says", [
    ('[{"role": "user", "content": "hi"}', "--prompt with --chat is not valid JSON: Expecting ',' delimiter"),
    ('[{"role": "wizard", "content": "hi"}]', "--prompt with --chat: a conversation with an unknown role "
                                              "(role 'wizard'); give a JSON list of "),
    ('{"messages": [{"role": "user", "content": 3}]}', "a conversation with content that is not a string"),
    ("[]", "a conversation with messages that are not a list of messages"),
])
def test_a_prompt_that_is_not_a_conversation_is_refused_before_any_file_is_read(tmp_path, capsys, prompt, says):
    err = refused(["infer-tp", "--checkpoint", str(tmp_path / "missing"), "--chat", "--prompt", prompt], capsys)
    assert says in err and "missing" not in err


def test_a_tokenizer_without_a_template_is_refused_before_loading(checkpoint, tmp_path, capsys, no_model_load):
    (tmp_path / "tok").mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, tmp_path / "tok" / "tokenizer.model")
    argv = ["infer-tp", "--checkpoint", str(checkpoint), "--chat", "--prompt", "hi",
            "--model.tokenizer_path", str(tmp_path / "tok" / "tokenizer.model")]
    assert "has no chat template" in refused(argv, capsys)
    with pytest.raises(AssertionError, match="loaded the model"):  # without --chat, it has no need of one
        main(argv[:3] + argv[4:])


def test_a_template_that_refuses_the_conversation_is_refused_before_loading(checkpoint, tmp_path, capsys,
                                                                            no_model_load):
    template = tmp_path / "strict.jinja"
    template.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}"
                        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    err = refused(["infer-tp", "--checkpoint", str(checkpoint), "--chat", "--prompt", "hi",
                   "--sft.chat_template_path", str(template)], capsys)
    assert err.endswith(f"--prompt with --chat: chat template {template} refused the conversation: a system turn "
                        "comes first")
    with pytest.raises(ConfigError, match="^--sft.chat_template_path renders the prompt of --chat only"):
        generation.run(checkpoint, "hi", overrides=["--sft.chat_template_path", str(template)])  # not ignored
    with pytest.raises(ConfigError, match="rendered the conversation as no text"):
        generation.run(checkpoint, '[{"role": "system", "content": ""}]', chat=True,
                       overrides=["--sft.chat_template_path", str(template)])


def test_infer_tp_chat_with_qwen3_5s_template_on_a_hybrid_model(tmp_path):
    """Qwen3.5's own template (tests/data/chat_templates/SOURCE.md) on a tiny Qwen3.5 (Gated DeltaNet layers
    decoding through their state cache): the prompt is apply_chat_template's, ending in the thinking turn's
    opening, <|im_end|> stops, and the answer is the model's own greedy continuation (a full forward per token)."""
    import torch.distributed.checkpoint as dcp

    transformers = pytest.importorskip("transformers")
    from tests.unit.chat_tokenizers import qwen_folder
    from tests.unit.hf_reference import unit_scale_
    from titanctl.models.common.args import LinearAttentionArgs
    from titanctl.models.qwen3_5.args import qwen3_5_args
    from titanctl.models.registry import build_model

    folder = qwen_folder(tmp_path / "qwen3_5", "qwen3_5_think.jinja")
    tokenizer = Tokenizer(folder)
    args = qwen3_5_args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn=96, tied=False, head_dim=16,
                        linear=LinearAttentionArgs(2, 4, 16, 16), vocab_size=tokenizer.vocab_size).replace(max_seq_len=128)
    torch.manual_seed(0)
    model = build_model(args)
    unit_scale_(model)  # logits far from ties: greedy tokens cannot flip on rounding
    ckpt = tmp_path / "ckpt"
    dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(ckpt), no_dist=True)
    write_metadata(ckpt, args, step=1, weights_only=True, dtype="float32")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the king said"}]
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exc:
        main(["infer-tp", "--checkpoint", str(ckpt), "--chat", "--prompt", json.dumps(messages),
              "--model.tokenizer_path", str(folder), "--temperature", "0", "--max-new-tokens", "4", "--out", str(out)])
    assert exc.value.code == 0
    data = json.loads(out.read_text())
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert data["prompt_tokens"] == list(want) and data["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    assert tokenizer.special_tokens["<|im_end|>"] in data["chat"]["stop_tokens"]
    ids = list(want)
    with torch.no_grad():
        for _ in data["tokens"]:
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    assert data["tokens"] == ids[len(want):]
