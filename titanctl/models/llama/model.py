"""Llama 3.x: the shared decoder (``titanctl.models.common``) with Meta's defaults.

Llama needs nothing beyond the shared blocks, so this module only names them where the rest of
titanctl has always imported them from (``titanctl.models.llama.model.Transformer`` etc.).
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.attention import CPU_FP32_ATTENTION_BELOW_HEAD_DIM, Attention, KVCache, attention
from titanctl.models.common.decoder import Transformer, TransformerBlock
from titanctl.models.common.feed_forward import FeedForward
from titanctl.models.common.init import ParamInit
from titanctl.models.common.norms import NORMS, FusedRMSNorm, RMSNorm, build_norm
from titanctl.models.common.rope import apply_rope, apply_rope_halves, rope_frequencies, rope_table

__all__ = [
    "CPU_FP32_ATTENTION_BELOW_HEAD_DIM",
    "NORMS",
    "Attention",
    "FeedForward",
    "FusedRMSNorm",
    "KVCache",
    "ModelArgs",
    "ParamInit",
    "RMSNorm",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "apply_rope_halves",
    "attention",
    "build_norm",
    "rope_frequencies",
    "rope_table",
]
