"""Trained state that a target format has no slot for: carried exactly, or refused.

Every writer but Hugging Face's stores every tensor of the model (dcp, torchtitan: the MoE expert
bias as ``expert_bias_E``; meta and torchtune are Llama's, which has no such state). Hugging Face's
Qwen3-MoE and gpt-oss formats have no slot for the expert bias that ``moe.load_balance_coeff`` trains
(``ModelSpec.hf.not_stored``): it reads back as zeros, so a model whose bias moved would route tokens
otherwise once exported. Such an export is refused unless ``--drop-expert-bias`` accepts the loss, and
a run that would write Hugging Face folders of it while training it does not start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    if not trained:
        return None
    more = f" (and {len(trained) - 1} more layers')" if len(trained) > 1 else ""
    if not drop:
        raise CheckpointError(
            f"{trained[0]}{more} holds trained values (moe.load_balance_coeff) that the Hugging Face {args.family} "
            f"format has no slot for: add {DROP_FLAG} to export without it (the exported model then routes tokens "
            "as if it were zero), or write --to dcp or torchtitan, which carry it"
        )
    return (f"{DROP_FLAG}: the trained expert bias of {len(trained)} layers was left out (Hugging Face's "
            f"{args.family} has no slot for it): the export routes tokens as with a zero bias, so its outputs "
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


__all__ = ["DROP_FLAG", "check_carried", "check_hf_saves"]
