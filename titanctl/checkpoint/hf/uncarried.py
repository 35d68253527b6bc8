"""Trained state that a target format has no slot for: carried exactly, or refused.

Every writer but Hugging Face's stores every tensor of the model (dcp, torchtitan: the MoE expert
bias as ``expert_bias_E``; meta and torchtune are Llama's, which has no such state). Hugging Face's
Qwen3-MoE and gpt-oss formats have no slot for the expert bias that ``moe.load_balance_coeff`` trains
(``ModelSpec.hf.not_stored``): it reads back as zeros, so a model whose bias moved would route tokens
otherwise once exported. Such an export is refused unless ``--drop-expert-bias`` accepts the loss, and
a run that would write Hugging Face folders of it while training it does not start. The same holds for a
LoRA step's adapters exported for peft (``--to peft``): peft adapts that Hugging Face model, whose bias is
zero, while the step holds the bias its run moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from titanctl.checkpoint.hf.names import hf_names_of
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import spec_of

if TYPE_CHECKING:  # a format's source is read here, never built: the formats sit above
    from titanctl.checkpoint.formats.base import Source

DROP_FLAG = "--drop-expert-bias"


def check_carried(source: Source, fmt: str, drop: bool) -> str | None:
    """None when `fmt` carries all of the source's state (or what it cannot hold is zero, as it reads
    back); else a CheckpointError, or with ``drop`` the note saying what the export loses."""
    if fmt != "hf":
        return None
    args = source.args
    uncarried = [info.name for info in source.infos if not hf_names_of(info.name, args)]
    trained = [name for name in uncarried if source.load(name).count_nonzero()]
    return _refused_or_noted(
        trained, drop, f"the Hugging Face {args.family} format has no slot for",
        "the exported model then routes tokens as if it were zero", "or write --to dcp or torchtitan, which carry it",
        f"Hugging Face's {args.family} has no slot for it): the export routes tokens as with a zero bias",
    )


def check_adapter_export(buffers: dict[str, torch.Tensor], args: ModelArgs, drop: bool,
                         base_tensors: Callable[[list[str]], dict[str, torch.Tensor]]) -> str | None:
    """``check_carried`` for ``--to peft``: peft adapts the Hugging Face model of the base, whose buffers
    are the base's where that format stores them (``base_tensors(names)`` reads them, only when a LoRA
    step's are not zero) and zero elsewhere. A LoRA step whose buffers are other values is refused (or,
    with ``drop``, noted)."""
    trained = [name for name, t in buffers.items() if not hf_names_of(name, args) and t.count_nonzero()]
    stored = [name for name, t in buffers.items() if hf_names_of(name, args) and t.count_nonzero()]
    if stored:
        base = base_tensors(stored)
        trained += [name for name in stored if not torch.equal(base[name], buffers[name])]
    return _refused_or_noted(
        trained, drop,
        f"peft cannot carry (it adapts the base's Hugging Face {args.family} model, which holds the base's bias)",
        "the adapters then route tokens with the base's bias",
        "or merge the adapters into a format that carries it (--merge-lora --to dcp or torchtitan)",
        "peft adapts the base's Hugging Face model): the adapters route tokens as with the base's bias",
    )


def _refused_or_noted(trained: list[str], drop: bool, lacking: str, then: str, instead: str, loss: str) -> str | None:
    if not trained:
        return None
    more = f" (and {len(trained) - 1} more layers')" if len(trained) > 1 else ""
    if not drop:
        raise CheckpointError(
            f"{trained[0]}{more} holds trained values (moe.load_balance_coeff) that {lacking}: add {DROP_FLAG} to "
            f"export without it ({then}), {instead}"
        )
    return (f"{DROP_FLAG}: the trained expert bias of {len(trained)} layers was left out ({loss}, so its outputs "
            "differ from titanctl's")


def check_hf_saves(load_balance_coeff: float, args: ModelArgs) -> None:
    """A run's Hugging Face saves (checkpoint.save_format, last_save_in_hf) cannot carry the expert bias
    it trains: refused before the first step."""
    if load_balance_coeff and args.moe is not None and "moe.expert_bias" in spec_of(args).hf.not_stored:
        raise ConfigError(
            f"moe.load_balance_coeff = {load_balance_coeff} trains an expert bias that the Hugging Face "
            f"{args.family} folders this run saves (checkpoint.save_format / last_save_in_hf) have no slot for: "
            "set load_balance_coeff = 0 (router_aux_loss_coef balances without it), or save dcp and convert "
            f"later ({DROP_FLAG} accepts the loss)"
        )


__all__ = ["DROP_FLAG", "check_adapter_export", "check_carried", "check_hf_saves"]
