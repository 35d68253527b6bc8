"""One debug-shaped model trained for a few steps, shared by the conversion tests of a session
(trained weights, not random ones: a conversion that garbles them shows in the loss and in the text)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from titanctl.checkpoint.convert import save_state_dict
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS

SEQ = 64
N_LAYERS = 2  # the debug flavor, two of its six layers (as tests/cli/test_train.py trains it)


def windows(ids: list[int], n: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """n windows of SEQ + 1 tokens: consecutive ones, or random ones with a generator."""
    data = torch.tensor(ids)
    if gen is None:
        starts = torch.arange(n) * (SEQ + 1)
    else:
        starts = torch.randint(0, len(data) - SEQ - 1, (n,), generator=gen)
    return torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])


def tokens_of(name: str, n_docs: int, tok: Tokenizer) -> list[int]:
    docs = itertools.islice(iter(load_documents(name, None)), n_docs)
    return [i for ids in tok.encode_batch(list(docs), bos=True, eos=True) for i in ids]


@torch.no_grad()
def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> float:
    out = model(batch[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()


def train_debug_model(folder: Path) -> dict:
    """The debug model trained for a few steps in process, saved by the dcp writer into `folder`."""
    tok = Tokenizer()
    args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=tok.vocab_size, max_seq_len=SEQ, n_layers=N_LAYERS)
    torch.manual_seed(0)
    model = Transformer(args)  # PyTorch's default init: cheap, and training starts from it alike
    held_out = windows(tokens_of("bundled_val", 12, tok), 16)
    before = loss_of(model.eval(), held_out)
    train_ids = tokens_of("bundled", 40, tok)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(12):
        batch = windows(train_ids, 8, gen)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    after = loss_of(model, held_out)
    assert after < before - 1.0, (before, after)  # it learned: these are trained weights
    save_state_dict(model.state_dict(), args, folder, "dcp")
    return {"folder": folder, "args": args, "loss": after, "held_out": held_out, "state": model.state_dict()}
