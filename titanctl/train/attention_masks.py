"""The attention mask of each training microbatch (``model.attn_mask_type``).

``causal`` hands the model no mask: its fast causal path runs unchanged. ``block_causal`` builds
a document mask once per microbatch from the whole (unsharded) input tokens, before pipeline or
context-parallel sharding: the pipeline splits it along the batch with the inputs and passes it to
every stage, and under context parallelism it is the mask of this rank's queries over all keys.
The model hands the one mask to every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError
from titanctl.models.common.document_mask import document_mask
from titanctl.parallel.layouts.context_parallel import document_cp_positions, enable_document_context_parallel
from titanctl.parallel.layouts.dims import ParallelDims


@dataclass
class MicrobatchMasks:
    bos_id: int | None  # None: causal, no mask
    cp_mesh: object | None = None  # the CP mesh when cp > 1 (block_causal only)

    @classmethod
    def build(
        cls, cfg: JobConfig, dims: ParallelDims, bos_id: int | None, model_parts: list[torch.nn.Module]
    ) -> MicrobatchMasks:
        """Check the setting against the tokenizer and prepare the layout (CP gathers keys)."""
        if cfg.model.attn_mask_type == "causal":
            return cls(bos_id=None)
        if bos_id is None:
            where = cfg.model.tokenizer_path or "the bundled tokenizer"
            raise ConfigError(
                f"model.attn_mask_type = {cfg.model.attn_mask_type} finds documents by their BOS token, but "
                f"{where} has none; use model.attn_mask_type = causal"
            )
        cp_mesh = None
        if dims.cp > 1:
            cp_mesh = dims.mesh["cp"]
            for part in model_parts:
                enable_document_context_parallel(part, cp_mesh)
        return cls(bos_id=bos_id, cp_mesh=cp_mesh)

    def __call__(self, inputs: torch.Tensor):
        """The mask for the model's ``attn_mask`` of a microbatch of whole windows (B, T); None: causal."""
        if self.bos_id is None:
            return None
        q_positions = kv_positions = None
        if self.cp_mesh is not None:
            q_positions, kv_positions = document_cp_positions(inputs.shape[1], self.cp_mesh)
        return document_mask(inputs, self.bos_id, q_positions=q_positions, kv_positions=kv_positions)
