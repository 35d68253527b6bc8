"""A Hugging Face source's config.json, carried through titanctl into the folders it exports.

A config.json says more than ``ModelArgs`` hold: sizes the model does not use (Qwen3-MoE's dense
``intermediate_size``), the context it was published for (``max_position_embeddings``), special
token ids, keys of other tools. Reading a Hugging Face folder keeps its config (``carried``); a DCP
checkpoint stores it in titanctl.json under ``hf_config`` (``convert``, and the steps of a training
run that started from such a checkpoint); every Hugging Face export writes it back
(``export_config``), as long as it still describes the model being written: titanctl must write the
same config.json from the model that config describes as from the model being exported (a run that
changed ``rope_theta`` no longer is the source's model). Otherwise, and for a model trained from
scratch, the config is written from the model's arguments (``hf.names.hf_config``).

``CHANGED_KEYS`` names every key an export may write differently from the carried config, and why.
"""

from __future__ import annotations

from typing import Any

from titanctl.checkpoint.hf.names import args_from_hf_config, hf_config
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs

HF_CONFIG_KEY = "hf_config"  # in titanctl.json and in a source's extra_metadata()

# Keys of a source's config.json that are not carried: they describe its files, not the model.
DROPPED_KEYS = {
    "transformers_version": "the version of transformers that wrote the source's file; titanctl writes the export",
    "quantization_config": "block-quantized FP8 and MXFP4 weights are dequantized when read: the export is not "
                           "quantized",
    "expert_dtype": "DeepSeek-V4's FP4 experts (its release declares them at the top level) are dequantized when "
                    "read: the export's experts are not FP4",
    "auto_map": "names remote-code files of the source folder, which are not carried",
    "_name_or_path": "where the source was loaded from",
    "_commit_hash": "the source's Hub revision",
}
# Keys that only one transformers version writes, added from the model's arguments where the carried
# config lacks them (or has null), so that transformers 4.x and 5.x build the same model from it.
VERSION_KEYS = {
    "rope_theta": "transformers 4.x reads RoPE's theta only from it (5.x writes it inside rope_parameters)",
    "rope_scaling": "transformers 4.x reads RoPE scaling only from it (5.x: rope_parameters); only when scaled",
    "num_experts": "Qwen3-MoE's expert count as transformers 4.x reads it (5.x writes num_local_experts)",
}
# Keys set from what the export holds.
WRITTEN_KEYS = {
    "dtype": "the dtype the weights are written in (--dtype, checkpoint.export_dtype)",
    "torch_dtype": "the dtype the weights are written in (transformers 4.x's name)",
    "bos_token_id": "the id of the tokenizer written beside the weights, when one is",
    "eos_token_id": "the id of the tokenizer written beside the weights, when one is",
}
CHANGED_KEYS = {**DROPPED_KEYS, **VERSION_KEYS, **WRITTEN_KEYS}


def carried(config: dict[str, Any]) -> dict[str, Any]:
    """What of a source's config.json a checkpoint carries: everything but ``DROPPED_KEYS``."""
    return {key: value for key, value in config.items() if key not in DROPPED_KEYS}


def why_not_described(config: dict[str, Any], args: ModelArgs) -> str | None:
    """None when the carried ``config`` describes the model of ``args`` (titanctl writes the same
    config.json from both models); else which keys of such a config.json differ."""
    try:
        described = args_from_hf_config(config, max_seq_len=args.max_seq_len, where="the carried config.json")
    except CheckpointError as e:
        return str(e)
    if args.mtp_layers == 0:  # prediction depths declared without their weights: as transformers writes them
        described = described.replace(mtp_layers=0)
    ours, theirs = hf_config(args), hf_config(described)
    differ = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
    return f"its {', '.join(differ)} differ{'s' if len(differ) == 1 else ''}" if differ else None


def export_config(
    args: ModelArgs,
    source_config: dict[str, Any] | None,
    *,
    dtype: str,
    token_ids: tuple[int | None, int | None] | None,
    default_token_ids: tuple[int | None, int | None],
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """The config.json of an export of the model ``args``: the carried ``source_config`` when it
    describes that model (``CHANGED_KEYS`` aside), else the one written from ``args`` (and a note
    why, when there was a carried one). ``token_ids``: (bos, eos) of the tokenizer written beside the
    weights, if any; ``default_token_ids``: the family's convention, for a config from ``args``."""
    bos, eos = token_ids or default_token_ids
    own = hf_config(args, torch_dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    if source_config is None:
        return own
    why = why_not_described(source_config, args)
    if why is not None:
        if notes is not None:
            notes.append(f"config.json written from the model's arguments: the source's config.json, carried in "
                         f"the checkpoint, describes another model ({why})")
        return own
    config = carried(source_config)
    for key in VERSION_KEYS:
        if config.get(key) is None and own.get(key) is not None:
            config[key] = own[key]
    config["dtype"] = config["torch_dtype"] = dtype
    if token_ids is not None:
        config["bos_token_id"], config["eos_token_id"] = token_ids
    return config


__all__ = ["CHANGED_KEYS", "HF_CONFIG_KEY", "carried", "export_config", "why_not_described"]
