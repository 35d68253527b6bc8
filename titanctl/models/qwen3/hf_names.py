"""Hugging Face ``Qwen3ForCausalLM`` names <-> titanctl's canonical names: renames only.

Qwen3's published weights rotate RoPE by halves, the layout titanctl's Qwen3 flavors compute in
(ModelArgs.rope_layout "halves"), so no tensor is permuted: a checkpoint converts name by name.
A tied checkpoint may lack ``lm_head.weight`` (transformers does not save it): the embedding
stands in for ``output.weight``, the key ``load_state_dict`` expects for the shared Parameter.
"""

from __future__ import annotations

import re

import torch

# Per-layer suffixes: titanctl -> Hugging Face.
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES_INV = {hf: ours for ours, hf in LAYER_NAMES.items()}
_TOP_NAMES_INV = {hf: ours for ours, hf in TOP_NAMES.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a titanctl Qwen3 weight (None: not one)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    m = _OURS_LAYER.fullmatch(name)
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}" if m and m.group(2) in LAYER_NAMES else None


def canonical_name(hf: str) -> str | None:
    """The titanctl name of a Hugging Face Qwen3 weight (None: not one)."""
    if hf in _TOP_NAMES_INV:
        return _TOP_NAMES_INV[hf]
    m = _HF_LAYER.fullmatch(hf)
    return f"layers.{m.group(1)}.{_LAYER_NAMES_INV[m.group(2)]}" if m and m.group(2) in _LAYER_NAMES_INV else None


def from_hf_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under titanctl names (unknown names raise KeyError)."""
    out = {}
    for name, tensor in sd.items():
        ours = canonical_name(name)
        if ours is None:
            raise KeyError(f"not a Qwen3ForCausalLM weight: {name!r}")
        out[ours] = tensor
    if tied and "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_state_dict(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """titanctl weights under Hugging Face names; a tied model's ``lm_head.weight`` is left out,
    as transformers writes it (safetensors refuses two names for one storage)."""
    out = {}
    for name, tensor in sd.items():
        if tied and name == "output.weight":
            continue
        hf = hf_name(name)
        if hf is None:
            raise KeyError(f"not a titanctl Qwen3 weight: {name!r}")
        out[hf] = tensor
    return out
