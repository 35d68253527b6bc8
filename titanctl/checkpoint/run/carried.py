"""The tensors a run carries for its Hugging Face folder without training them: a vision-language folder's
vision encoder and multi-token-prediction head (``titanctl.checkpoint.hf.hub_layout``).

A run that starts from such a folder (or from a DCP checkpoint converted from one, or resumes a step of
such a run) builds the text model only. The other tensors ride along as they were stored (names, dtypes,
bytes): every rank knows their names, shapes and dtypes (an HF save's ranks walk the same write order),
rank 0 alone holds their values, in host memory, for the whole run; the DCP steps store them under
``hf_carried.*`` (rank 0 writes them; a LoRA run's steps do not, its base holds them) and the run's Hugging
Face saves write them back, under the folder's wrapper config.json.
"""

from __future__ import annotations

from typing import Any

import torch

from titanctl.checkpoint.formats.base import Source, TensorInfo
from titanctl.checkpoint.formats.dcp import carried_infos, carried_key

HOLDER = 0  # the rank that holds the values (and writes the files of every save)


class CarriedTensors:
    """What a run carries: ``infos`` on every rank, ``values`` ({stored name: tensor}) on ``HOLDER``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.infos: list[TensorInfo] = []
        self.values: dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.infos)

    def take_from(self, source: Source) -> None:
        """The carried tensors of a bound checkpoint source (another tool's folder), read by ``HOLDER``."""
        self.infos = list(source.carried)
        self.values = {info.name: source.load_carried(info.name) for info in self.infos} if self.rank == HOLDER else {}

    def placeholders(self, entries: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
        """For a DCP load of a step's entries: the tensors ``HOLDER`` reads them into ({DCP key: tensor};
        empty elsewhere). ``absorb`` takes them once loaded."""
        self.infos = carried_infos(entries, where)
        if self.rank != HOLDER:
            return {}
        return {info.shown: torch.empty(info.shape, dtype=info.dtype) for info in self.infos}

    def absorb(self, state: dict[str, Any], placeholders: dict[str, torch.Tensor]) -> None:
        """Take the loaded placeholders out of a DCP state dict."""
        self.values = {info.name: state.pop(info.shown) for info in self.infos if info.shown in placeholders}

    def keep_unless_replaced(self, earlier: CarriedTensors) -> None:
        """A LoRA step holds none of them: what its base carried stays."""
        if not self.infos:
            self.infos, self.values = earlier.infos, earlier.values

    def save_state(self) -> dict[str, torch.Tensor]:
        """Their entries of a DCP save ({DCP key: tensor}, on ``HOLDER``; empty elsewhere)."""
        return {carried_key(name): tensor for name, tensor in self.values.items()}


__all__ = ["CarriedTensors"]
