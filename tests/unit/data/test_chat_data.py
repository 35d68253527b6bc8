"""Chat data (training.dataset = "chat:..."): the files and layouts it reads, bad rows counted and said in
one line (never a crash), conversations longer than seq_len cut or dropped, a dataset with nothing
usable refused in one line, mixtures with text, and the config checks that go with it."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from titanctl.config.recipe import load_config
from titanctl.data.chat import ChatSource
from titanctl.data.chat_pack import IGNORE_INDEX, LABELS, POSITIONS, TOKENS
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.data.mixture import WeightedSource, sources_from_config
from titanctl.errors import ConfigError, DataError

GOOD = {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who wrote it?"},
                     {"role": "assistant", "content": "Moses, they say."}, {"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": "Joshua."}]}
BAD = [
    ({"messages": [{"role": "user", "content": "no answer"}]}, "without an assistant turn"),
    ({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "with an unknown role"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "x"}]},
     "with content that is not a string"),
    ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
     "with content that is not a string"),
    ({"text": "plain text"}, "without messages (or prompt and completion)"),
    ({"messages": "hello"}, "with messages that are not a list of messages"),
    (["a", "list"], "not a JSON object"),
]


def write_jsonl(path, rows, extra: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


def test_bad_rows_are_counted_and_said_in_one_line(tok, tmp_path, offline_data):
    rows = [GOOD] * 6 + [row for row, _ in BAD]
    path = write_jsonl(tmp_path / "chat.jsonl", rows, extra='{"messages": [\n\xff\xfe\n')
    path.write_bytes(path.read_bytes().replace("\xff\xfe".encode(), b"\xff\xfe"))
    source = ChatSource(str(path))
    windows = source.windows(tok, 64)
    report = source.report
    assert report.rows == len(rows) + 2 and report.used == 6
    assert report.skipped["with content that is not a string"] == 2
    for _, reason in BAD:
        assert reason in report.skipped
    assert report.skipped["not valid JSON"] == 1 and report.skipped["not UTF-8"] == 1
    summary = report.summary()
    assert "\n" not in summary and "6 of 15 conversations" in summary and "chat.jsonl:8: role 'bot'" in summary
    assert "; 2 rows with content that is not a string" in summary and "; 1 row with an unknown role" in summary
    assert windows.shape[1:] == (3, 64) and (windows[:, LABELS] != IGNORE_INDEX).sum() == report.targets


def test_a_dataset_with_no_usable_row_is_one_line(tok, tmp_path, offline_data):
    path = write_jsonl(tmp_path / "chat.jsonl", [row for row, _ in BAD])
    with pytest.raises(DataError) as e:
        ChatSource(str(path)).windows(tok, 64)
    message = str(e.value)
    assert "no usable conversation among 7 rows" in message and "1 row without an assistant turn" in message
    assert "\n" not in message


def test_prompt_completion_rows_become_a_user_and_an_assistant_turn(tok, tmp_path, offline_data):
    rows = [{"prompt": "2 + 2?", "completion": "4"},
            {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]},
            {"prompt": "no completion"}]
    source = ChatSource(str(write_jsonl(tmp_path / "pc.jsonl", rows)))
    windows = source.windows(tok, 64)
    assert source.report.used == 2 and source.report.skipped == {"without messages (or prompt and completion)": 1}
    learned = windows[:, LABELS][windows[:, LABELS] != IGNORE_INDEX]
    assert tok.decode(learned.tolist()) in ("4<|eot_id|>Hello<|eot_id|>", "Hello<|eot_id|>4<|eot_id|>")


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_a_conversation_longer_than_seq_len_is_dropped_or_cut(tok, tmp_path, offline_data, overlong):
    long = {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "word " * 200}]}
    late = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "late"}]}
    source = ChatSource(str(write_jsonl(tmp_path / "long.jsonl", [GOOD, long, late])), overlong=overlong)
    windows = source.windows(tok, 64)
    report = source.report
    if overlong == "drop":
        assert (report.used, report.too_long) == (1, 2) and "2 longer than seq_len dropped" in report.summary()
    else:  # the long answer is cut (still something to learn); the late one loses all it had to learn
        assert (report.used, report.truncated) == (2, 1)
        assert report.skipped == {"with nothing to learn within seq_len tokens": 1}
        assert (windows[:, POSITIONS] == 63).any()  # a whole window of one cut conversation


def test_train_on_settings(tok, tmp_path, offline_data):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    learned = {}
    for train_on in ("assistant", "last_assistant", "all"):
        windows = ChatSource(str(path), train_on=train_on).windows(tok, 128)
        labels = windows[0, LABELS]
        learned[train_on] = tok.decode(labels[labels != IGNORE_INDEX].tolist())
    assert learned["assistant"] == "Moses, they say.<|eot_id|>Joshua.<|eot_id|>"
    assert learned["last_assistant"] == "Joshua.<|eot_id|>"
    assert learned["all"].startswith("<|start_header_id|>system") and learned["all"].endswith("Joshua.<|eot_id|>")


def test_files_and_hub_folder_layouts(tok, tmp_path, offline_data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with gzip.open(tmp_path / "chat.jsonl.gz", "wt") as f:
        f.write(json.dumps(GOOD) + "\n")
    (tmp_path / "chat.json").write_text(json.dumps([GOOD, GOOD]))
    pq.write_table(pa.Table.from_pylist([GOOD, {"messages": [{"role": "user", "content": "hi", "name": None},
                                                             {"role": "assistant", "content": "yo"}]}]),
                   tmp_path / "chat.parquet")
    assert ChatSource(str(tmp_path / "chat.jsonl.gz")).windows(tok, 64) is not None
    for name, used in (("chat.jsonl.gz", 1), ("chat.json", 2), ("chat.parquet", 2)):
        source = ChatSource(str(tmp_path / name))
        source.windows(tok, 64)
        assert source.report.used == used and not source.report.skipped, name
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("# a dataset card")
    pq.write_table(pa.Table.from_pylist([GOOD] * 3), repo / "data" / "train-00000-of-00001.parquet")
    write_jsonl(repo / "data" / "validation-00000-of-00001.jsonl", [GOOD])
    for target in (str(repo), f"hf:{repo}"):
        train, validation = ChatSource(target), ChatSource(target, split="validation")
        train.windows(tok, 64)
        validation.windows(tok, 64)
        assert (train.report.used, validation.report.used) == (3, 1)
    with pytest.raises(DataError, match="has no 'test' split \\(splits: train, validation\\)"):
        ChatSource(str(repo), split="test")
    (repo / "data" / "train-00001-of-00001.jsonl").symlink_to(tmp_path / "chat.jsonl.gz")
    with pytest.raises(DataError, match="resolves outside"):
        ChatSource(str(repo))


@pytest.mark.parametrize("target, says", [
    ("hf:someone/chats", "offline or unreachable"),
    ("missing.jsonl", "does not exist"),
    ("notes.txt", "unsupported type"),
    ("", "names nothing"),
])
def test_unusable_targets_are_one_line(tmp_path, offline_data, monkeypatch, target, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=says) as e:
        ChatSource(target)
    assert "\n" not in str(e.value)


def test_chat_data_needs_block_causal_masking():
    with pytest.raises(ConfigError, match="needs model.attn_mask_type = 'block_causal'"):
        load_config(None, ["--training.dataset", "chat:x.jsonl"])
    load_config(None, ["--training.dataset", "chat:x.jsonl", "--model.attn_mask_type", "block_causal"])
    mixture = '[{name = "chat:a", split = "test", weight = 1}, {name = "bundled"}]'
    load_config(None, ["--training.datasets", mixture, "--model.attn_mask_type", "block_causal"])
    with pytest.raises(ConfigError, match="text_field applies only to hf: datasets"):
        load_config(None, ["--training.datasets", '[{name = "chat:a", text_field = "t"}]',
                           "--model.attn_mask_type", "block_causal"])


def test_a_mixture_of_chat_and_text_gives_every_window_positions(tok, tmp_path, offline_data):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 40)
    cfg = load_config(None, ["--training.datasets", f'[{{name = "chat:{path}", weight = 1}}, {{name = "bundled"}}]',
                             "--model.attn_mask_type", "block_causal", "--sft.train_on", "last_assistant"])
    sources = sources_from_config(cfg.training, cfg.sft)
    assert isinstance(sources[0], WeightedSource) and sources[0].source.train_on == "last_assistant"
    loader = TokenWindowLoader(sources, tok, seq_len=64, global_batch_size=16, local_batch_size=8, dp_rank=0,
                               dp_degree=1, seed=0)
    assert loader.chat and loader.notes and "40 of 40 conversations" in loader.notes[0]
    rows = torch.cat([torch.stack(mb, dim=1) for mb in loader.next_step()])  # (16, 3, 64)
    text = (rows[:, LABELS] != IGNORE_INDEX).all(dim=1)
    assert 0 < text.sum() < 16  # both kinds in the batch
    for row in rows[text]:  # text: labels are the next tokens, positions restart at each BOS
        tokens, positions = row[TOKENS].numpy(), row[POSITIONS].numpy()
        bos = np.flatnonzero(tokens == tok.bos_id)
        assert (positions[bos] == 0).all() and (np.diff(positions)[tokens[1:] != tok.bos_id] == 1).all()


@pytest.mark.parametrize("overrides, says", [
    (["--sft.train_on", "all"], "'sft.train_on' = 'all' acts on chat data only"),
    (["--sft.overlong", "truncate"], "'sft.overlong' = 'truncate' acts on chat data only"),
    (["--training.dataset", "chat:x", "--model.attn_mask_type", "block_causal", "--sft.validation_split", "test"],
     "validation reads no chat data"),
])
def test_sft_keys_without_chat_data_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)
