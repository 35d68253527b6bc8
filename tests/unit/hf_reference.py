"""Helpers for tests that compare titanctl with a transformers model built in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from titanctl.checkpoint.hf.carried_config import CHANGED_KEYS
from titanctl.checkpoint.hf.names import args_from_hf_config, from_hf_state_dict
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import build_model


def tokens(vocab: int) -> torch.Tensor:
    """The token ids parity tests feed both models: 2 sequences of 48, seed 0."""
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))


IDS = tokens(512)  # the references' vocabularies are 512


def args_of(theirs, max_seq_len: int = 64) -> ModelArgs:
    """titanctl's ModelArgs of a transformers model, read from its config as a config.json is."""
    return args_from_hf_config(theirs.config.to_dict(), max_seq_len=max_seq_len)


def saved_state_dict(theirs) -> dict[str, torch.Tensor]:
    """``theirs``' state dict under the names save_pretrained writes (transformers' conversion mapping
    reversed: DeepSeek-V4's own names, experts one tensor per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(theirs, theirs.state_dict()))


def titanctl_model_of(theirs, args: ModelArgs | None = None, read_as: ModelArgs | None = None,
                      state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """titanctl's model of ``args`` (default: theirs') holding ``theirs``' weights (``state``: them under
    other names, default its state dict), read through the family's Hugging Face names as ``read_as``
    (default: theirs' args) says, in eval mode."""
    model = build_model(args or args_of(theirs))
    state = theirs.state_dict() if state is None else state
    model.load_state_dict(from_hf_state_dict(state, read_as or args_of(theirs)), strict=True)
    return model.eval()


@torch.no_grad()
def max_logit_delta(ours: nn.Module, theirs, ids: torch.Tensor = IDS) -> float:
    """max |Δlogit| of titanctl's model against transformers' on ``ids``."""
    return (ours(ids) - theirs(ids).logits).abs().max().item()


@torch.no_grad()
def unit_scale_(model: nn.Module, gen: torch.Generator | None = None) -> None:
    """Weights at unit scale (FACTS.md): embeddings std 1, matrices std 1/sqrt(fan_in), norms and other
    vectors 1 + 0.2 N(0, 1) (``gen``: seed 0 when not given). Routing and attention far from uniform, so
    that no logit or expert choice is near a tie that rounding could flip, and RoPE or a missing
    permutation moves logits by ~1, not ~1e-3 as at init scale."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def per_expert_layout(packed: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """A packed Hugging Face state dict (transformers 5's in-memory experts.gate_up_proj / down_proj)
    in the one-tensor-per-expert names its save_pretrained writes; ``hidden`` is the experts' hidden width."""
    out = {}
    for name, tensor in packed.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = tensor[e, :hidden].clone()
                out[f"{base}{e}.up_proj.weight"] = tensor[e, hidden:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def assert_round_trip_keeps_the_folder(source: Path, exported: Path) -> dict:
    """``exported`` (HF -> ... -> HF of ``source``, a folder transformers saved) holds the same tensors,
    bit for bit under the same names, the same index (weight_map's names, metadata) when the source has
    one, and the same config.json but for the keys titanctl documents (``CHANGED_KEYS``; a wrapper's
    text_config likewise). Returns the exported config."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}

    before, after = tensors(source), tensors(exported)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    if (source / "model.safetensors.index.json").is_file():
        theirs, ours = (json.loads((f / "model.safetensors.index.json").read_text()) for f in (source, exported))
        assert ours["weight_map"].keys() == theirs["weight_map"].keys() and ours["metadata"] == theirs["metadata"]
    theirs, ours = (json.loads((f / "config.json").read_text()) for f in (source, exported))
    _assert_same_config(theirs, ours)
    return ours


def _assert_same_config(theirs: dict, ours: dict) -> None:
    """The same keys and values but for ``CHANGED_KEYS``; a vision-language wrapper's text_config by the same rule."""
    absent = object()
    changed = {key for key in theirs.keys() | ours.keys() if theirs.get(key, absent) != ours.get(key, absent)}
    if "text_config" in changed and isinstance(theirs.get("text_config"), dict):
        _assert_same_config(theirs["text_config"], ours["text_config"])
        changed.remove("text_config")
    assert changed <= CHANGED_KEYS.keys(), {k: (theirs.get(k), ours.get(k)) for k in changed - CHANGED_KEYS.keys()}
