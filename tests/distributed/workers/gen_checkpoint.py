"""A tiny trained Llama for generation tests, saved as a weights-only DCP step folder and as a
Hugging Face folder (config.json + model.safetensors).

    python gen_checkpoint.py OUT      # writes OUT/dcp/step-40 and OUT/hf

Also importable: ``make_checkpoints(out)`` returns (dcp folder, hf folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from titanctl.data.tokenizer import Tokenizer
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.weight_init import initialize_weights

TEXT = "The quick brown fox jumps over the lazy dog, and the cat sleeps by the warm fire. "
STEPS = 30
SEQ_LEN = 48


def tiny_args(vocab_size: int) -> ModelArgs:
    # 4 query heads and 2 KV heads: tensor parallel 2 works, 3 does not.
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=32,
                     max_seq_len=SEQ_LEN)


def train_tiny(seed: int = 0) -> tuple[Transformer, ModelArgs]:
    """A few AdamW steps on one repeated sentence, so greedy decoding has something to say."""
    tokenizer = Tokenizer()
    args = tiny_args(tokenizer.vocab_size)
    torch.manual_seed(seed)
    model = Transformer(args)
    initialize_weights(model, seed)
    ids = torch.tensor(tokenizer.encode(TEXT * 20, bos=True, eos=False))
    windows = ids[: (len(ids) - 1) // SEQ_LEN * SEQ_LEN + 1]
    inputs = windows[:-1].view(-1, SEQ_LEN)
    labels = windows[1:].view(-1, SEQ_LEN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), args


def make_checkpoints(out: Path) -> tuple[Path, Path]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from titanctl.checkpoint.hf.names import hf_config, to_hf_state_dict
    from titanctl.checkpoint.trust.metadata import write_metadata

    model, args = train_tiny()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp_folder = Path(out) / "dcp" / f"step-{STEPS}"
    dcp_folder.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(dcp_folder))  # one process, no process group
    write_metadata(dcp_folder, args, step=STEPS, weights_only=True, dtype="float32")
    hf_folder = Path(out) / "hf"
    hf_folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(state, args).items()},
              str(hf_folder / "model.safetensors"))
    (hf_folder / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    return dcp_folder, hf_folder


if __name__ == "__main__":
    print(*make_checkpoints(Path(sys.argv[1])))
