"""Llama 3.x: the shared decoder (``titanctl.models.common``) with Meta's layout and flavors.
Its spec is ``titanctl.models.llama.spec.SPEC``."""

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS

__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer"]
