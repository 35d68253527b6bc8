"""Exact packing: a packed window's loss is the per-conversation losses that transformers computes one
conversation at a time, unpacked; and the step's loss is the mean over every learned token of the
global batch, whatever the gradient accumulation.

The reference is independent of titanctl's chat code: transformers' own ``apply_chat_template`` gives
each conversation's ids and assistant mask (trl's Qwen3 training template, with generation marks),
and ``Qwen3ForCausalLM`` on the same weights gives the losses. The tokenizer is Qwen-like (no BOS,
the end of turn is its EOS), so no token id can mark where a conversation starts. The same holds for a hybrid
family (``Qwen3_5MoeForCausalLM``: the Gated DeltaNet's state restarts at each conversation).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.unit.chat_tokenizers import qwen_folder, sample_conversations
from tests.unit.hf_reference import titanctl_model_of
from tests.unit.models.families import qwen3_model
from titanctl.config.recipe import load_config
from titanctl.data.chat import ChatSource
from titanctl.data.chat_pack import IGNORE_INDEX, LABELS, POSITIONS, TOKENS, first_fit_decreasing, pack_windows
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.qwen3.args import qwen3_args
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.train.step import ForwardBackward

transformers = pytest.importorskip("transformers")

SEQ = 160


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    folder = qwen_folder(root / "qwen", "qwen3_training.jinja")
    rows = sample_conversations(100, seed=11)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = Tokenizer(folder / "tokenizer.json")
    source = ChatSource(str(root / "chat.jsonl"))
    windows = np.array(source.windows(tokenizer, SEQ))
    args = qwen3_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, tied=False, head_dim=16,
                      vocab_size=tokenizer.vocab_size).replace(max_seq_len=SEQ)
    theirs = qwen3_model(args)
    theirs.config._attn_implementation = "eager"
    return dict(rows=rows, source=source, windows=windows, theirs=theirs, ours=titanctl_model_of(theirs, args, read_as=args),
                hf_tokenizer=transformers.AutoTokenizer.from_pretrained(folder), tokenizer=tokenizer)


def forward_backward(model, microbatches_per_step: int = 1) -> ForwardBackward:
    cfg = load_config(None, ["--model.name", "qwen3", "--model.attn_mask_type", "block_causal",
                             "--training.mixed_precision_param", "float32"])
    return ForwardBackward(cfg, ParallelDims.from_config(cfg.parallelism, 1), [model], None, torch.device("cpu"),
                           chat=True)


@torch.no_grad()
def reference_losses(setup) -> dict[tuple[int, ...], float]:
    """Each usable conversation's summed loss over its assistant tokens, by transformers, unpacked;
    keyed by its token ids."""
    out = {}
    for row in setup["rows"]:
        got = setup["hf_tokenizer"].apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True,
                                                        return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = torch.tensor(got["input_ids"]), torch.tensor(got["assistant_masks"], dtype=torch.bool)
        if len(ids) > SEQ:
            continue  # sft.overlong = drop
        logits = setup["theirs"](ids[None]).logits[0].float()
        labels = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
        out[tuple(ids.tolist())] = F.cross_entropy(logits[:-1], labels, reduction="sum").item()
    return out


def test_windows_pack_whole_conversations_with_positions_as_the_boundary(setup):
    windows, report = setup["windows"], setup["source"].report
    assert report.used == len(reference_losses(setup)) and report.too_long == report.rows - report.used
    assert (windows[:, POSITIONS] == 0).sum(axis=1).min() >= 2  # every window holds several conversations
    eos = setup["tokenizer"].eos_id  # <|im_end|>: Qwen's end of turn, inside every conversation
    starts = windows[:, POSITIONS] == 0
    assert (windows[:, TOKENS] == eos).sum() > starts.sum()  # the EOS id is no boundary
    assert report.windows == len(windows) and report.tokens / (len(windows) * SEQ) > 0.8


def per_conversation_losses(setup, model, windows, **model_kwargs) -> dict[tuple[int, ...], float]:
    """The summed loss of each conversation in packed windows, from one forward per window batch."""
    tokens, labels, positions = (torch.from_numpy(windows[:, row]).long() for row in (TOKENS, LABELS, POSITIONS))
    fb = forward_backward(model)
    kwargs = {"attn_mask": fb.attn_masks(tokens, positions), "positions": positions, **model_kwargs}
    with torch.no_grad():
        logits = model(tokens, **{k: v for k, v in kwargs.items() if v is not None})
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    out = {}
    for w in range(len(windows)):
        starts = [*np.flatnonzero(windows[w, POSITIONS] == 0).tolist(), SEQ]
        for a, b in zip(starts, starts[1:]):
            if (windows[w, LABELS, a:b] != IGNORE_INDEX).any():  # the padding learns nothing
                out[tuple(windows[w, TOKENS, a:b].tolist())] = per_token[w, a:b].sum().item()
    return out


def test_a_packed_windows_loss_equals_transformers_per_conversation(setup):
    want = reference_losses(setup)
    got = per_conversation_losses(setup, setup["ours"], setup["windows"])
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - v) / abs(v) for k, v in want.items())
    print(f"\nPACKED vs transformers unpacked: {len(want)} conversations, max rel diff {worst:.2e}")
    assert worst <= 1e-5
    # The same model without the conversation mask (one causal stream per window) is far off: the
    # comparison can fail.
    leaky = per_conversation_losses(setup, setup["ours"], setup["windows"], attn_mask=None)
    assert max(abs(leaky[k] - v) / abs(v) for k, v in want.items()) > 1e-2


def test_padding_never_counts(setup):
    windows = setup["windows"].copy()
    padding = np.zeros(windows[:, TOKENS].shape, dtype=bool)
    for w in range(len(windows)):
        last_start = np.flatnonzero(windows[w, POSITIONS] == 0)[-1]
        if (windows[w, LABELS, last_start:] == IGNORE_INDEX).all():
            padding[w, last_start:] = True
    assert padding.any() and (windows[:, LABELS][padding] == IGNORE_INDEX).all()
    before = step_loss(setup, windows, 1)
    windows[:, TOKENS][padding] = np.random.default_rng(0).integers(0, 4000, padding.sum())
    assert step_loss(setup, windows, 1) == pytest.approx(before, rel=1e-6)


def uneven(windows: np.ndarray) -> np.ndarray:
    """8 windows, the 4 that learn the fewest tokens first: microbatches then learn unequal numbers of tokens."""
    order = np.argsort((windows[:, LABELS] != IGNORE_INDEX).sum(axis=1), kind="stable")
    return windows[np.concatenate([order[:4], order[-4:]])]


def step_loss(setup, windows, accumulation: int, *, naive: bool = False):
    model = setup["ours"]
    model.zero_grad(set_to_none=True)
    batch = torch.from_numpy(windows[:8]).long()
    microbatches = [(rows[:, TOKENS].contiguous(), rows[:, LABELS].contiguous(), rows[:, POSITIONS].contiguous())
                    for rows in batch.split(8 // accumulation)]
    fb = forward_backward(model)
    if naive:  # the mean of per-microbatch means: what the loss must not be
        return sum(fb.microbatch(*mb[:2], (mb[1] != IGNORE_INDEX).sum() * accumulation, positions=mb[2])
                   for mb in microbatches).item()
    return fb(microbatches).item()


def test_gradient_accumulation_gives_the_global_token_mean(setup):
    model = setup["ours"]
    windows = uneven(setup["windows"])
    one = step_loss(setup, windows, 1)
    grads_one = {n: p.grad.clone() for n, p in model.named_parameters()}
    four = step_loss(setup, windows, 4)
    grads_four = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert four == pytest.approx(one, rel=1e-5)
    worst = max(((grads_four[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_one.items())
    assert worst <= 1e-5, worst
    naive = step_loss(setup, windows, 4, naive=True)
    print(f"\nACCUMULATION 1 vs 4: {one:.6f} vs {four:.6f}; mean of microbatch means {naive:.6f}")
    assert abs(naive - one) / one > 1e-3  # the microbatches learn different numbers of tokens
    model.zero_grad(set_to_none=True)


def test_first_fit_decreasing_never_splits_and_fills_well():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, 2000)
    window = first_fit_decreasing(lengths, 100)
    room = np.bincount(window, weights=lengths)
    assert room.max() <= 100 and np.bincount(window).min() >= 1
    assert len(room) <= 1.05 * lengths.sum() / 100 + 1  # near the bound of no waste at all
    convs = [(np.arange(n, dtype=np.int32), np.ones(n, dtype=bool)) for n in (5, 3, 4, 1)]
    packed = pack_windows(convs, 8, pad_id=99)
    assert packed.shape == (2, 3, 8)
    assert packed[0, TOKENS].tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and packed[0, POSITIONS].tolist() == [
        0, 1, 2, 3, 4, 0, 1, 2]
    assert packed[0, LABELS].tolist() == [1, 2, 3, 4, IGNORE_INDEX, 1, 2, IGNORE_INDEX]
    assert packed[1, TOKENS].tolist() == [0, 1, 2, 3, 0, 99, 99, 99]
    assert packed[1, POSITIONS].tolist() == [0, 1, 2, 3, 0, 0, 1, 2]  # the padding: its own span
    assert packed[1, LABELS].tolist() == [1, 2, 3, IGNORE_INDEX] + [IGNORE_INDEX] * 4


def test_the_loader_shuffles_packed_windows_and_resumes_exactly(setup):
    def loader(dp_rank=0, dp=1, local=4):
        return TokenWindowLoader(setup["source"], setup["tokenizer"], seq_len=SEQ, global_batch_size=8,
                                 local_batch_size=local, dp_rank=dp_rank, dp_degree=dp, seed=3)

    first = loader()
    steps = [first.next_step() for _ in range(3)]
    assert all(len(mb) == 3 and mb[2].shape == (4, SEQ) for step in steps for mb in step)
    state = first.state_dict()
    resumed = loader(dp_rank=1, dp=2, local=2)
    resumed.load_state_dict(state)
    again = loader()
    again.load_state_dict(state)
    want = torch.cat([mb[0] for mb in first.next_step()])
    assert torch.equal(torch.cat([mb[0] for mb in again.next_step()]), want)
    assert torch.equal(torch.cat([mb[0] for mb in resumed.next_step()]), want[1::2])  # samples i with i mod 2 = 1
    assert first.fingerprint["chat_template"] == setup["source"].template_sha256


def test_rope_positions_restart_at_each_conversation(setup):
    """Every attention layer rotates a token by its position in its own conversation, not in the window."""
    model, windows = setup["ours"], setup["windows"][:2]
    tokens, positions = (torch.from_numpy(windows[:, row]).long() for row in (TOKENS, POSITIONS))
    seen = []
    hooks = [layer.attention.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
             for layer in model.layers.values()]
    try:
        with torch.no_grad():
            model(tokens, attn_mask=forward_backward(model).attn_masks(tokens, positions), positions=positions)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(model.layers) and (positions == 0).sum() > 2
    assert all(torch.equal(rope, model.rope_cache[positions]) for rope in seen)


def test_validation_of_chat_data_is_the_mean_over_the_learned_tokens(setup):
    from titanctl.train.validate import ValidationSet, Validator

    windows, model = uneven(setup["windows"]), setup["ours"]
    data = ValidationSet(windows, "chat", seq_len=SEQ, global_batch_size=4, local_batch_size=2, dp_rank=0,
                         dp_degree=1, steps=-1)
    fb = forward_backward(model)
    result = Validator(load_config(None, []).validation, data, fb, fb.dims).run(0)
    tokens, labels, positions = (torch.from_numpy(windows[:, row]).long() for row in (TOKENS, LABELS, POSITIONS))
    with torch.no_grad():
        logits = model(tokens, attn_mask=fb.attn_masks(tokens, positions), positions=positions)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
    assert data.batches == 2 and result.loss == pytest.approx(expected, rel=1e-6)


def test_qwen3_5_moe_packed_windows_equal_transformers_per_conversation(setup):
    """Chat SFT on a hybrid family: the Gated DeltaNet's conv window and state restart at each packed
    conversation, so each conversation's loss in a packed window is what ``Qwen3_5MoeForCausalLM`` computes
    on it alone (the last six windows, the fullest; fp32: measured 6e-7)."""
    from tests.unit.hf_reference import args_of, unit_scale_
    from tests.unit.models.families import qwen3_5_moe_config

    torch.manual_seed(0)
    theirs = transformers.Qwen3_5MoeForCausalLM(qwen3_5_moe_config(
        vocab_size=setup["tokenizer"].vocab_size, max_position_embeddings=SEQ)).eval()
    unit_scale_(theirs)
    ours = titanctl_model_of(theirs, args_of(theirs, SEQ), read_as=args_of(theirs, SEQ))
    got = per_conversation_losses(setup, ours, setup["windows"][-6:])
    want = {}
    with torch.no_grad():
        for row in setup["rows"]:
            t = setup["hf_tokenizer"].apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True,
                                                          return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = torch.tensor(t["input_ids"]), torch.tensor(t["assistant_masks"], dtype=torch.bool)
            if tuple(ids.tolist()) in got:
                logits = theirs(ids[None]).logits[0]
                labels = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
                want[tuple(ids.tolist())] = F.cross_entropy(logits[:-1], labels, reduction="sum").item()
    assert want.keys() == got.keys(), [len(k) for k in got.keys() - want.keys()]
    assert len(got) >= 10
    worst = max(abs(got[k] - v) / abs(v) for k, v in want.items())
    print(f"\nQWEN3.5-MOE PACKED vs transformers unpacked: {len(want)} conversations, max rel diff {worst:.2e}")
    assert worst <= 1e-4
    # Without the conversation mask the state and conv window run on across conversations: far off (measured
    # 7e-3, four orders above the packed run's difference).
    leaky = per_conversation_losses(setup, ours, setup["windows"][-6:], attn_mask=None)
    assert max(abs(leaky[k] - v) / abs(v) for k, v in want.items()) > 1e-3
