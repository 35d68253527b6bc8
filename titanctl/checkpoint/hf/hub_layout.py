"""The Hub's vision-language folders of a text family (Qwen3.5's published checkpoints): the text model read
from under ``model.language_model.``, the parts titanctl does not build carried unchanged, and the folder's
spelling and wrapper config carried to exports.

Qwen/Qwen3.5-35B-A3B and the dense Qwen3.5 releases are ``*ForConditionalGeneration`` folders: config.json
wraps the text model's config in ``text_config`` (beside ``vision_config``), the text weights are
``model.language_model.{embed_tokens,layers.*,norm}`` and ``lm_head``, routed experts are packed
(``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]), and the folder also holds the
vision encoder (``model.visual.*``) and the multi-token-prediction head (``mtp.*``). titanctl builds the text
model; those two are carried as they are stored (names, dtypes, bytes): a DCP checkpoint keeps them under
``CARRIED_PART`` (``hf_carried.<stored name>``, beside the model's tensors and apart from them), a run that
started from the folder keeps them through its steps, and a Hugging Face export writes them back, so the
export is the folder again (``*ForConditionalGeneration``, the wrapper's config.json around the text model's).
``HubNaming`` is how the folder spells and wraps the text model; it travels with the folder's file layout
(``hf.names.HF_FILES_KEY``). A text-only export (``--text-only``) leaves the carried parts out and writes the
text model's ``*ForCausalLM`` config.json (``unwrapped_config``) under the folder's names, which
``Qwen3_5MoeForCausalLM`` reads (transformers' conversion mapping strips the prefix, as it does for the wrapper).

A family's published folder may also name the decoder without the ``model.`` prefix that ``save_pretrained``
writes (DeepSeek-V4's: ``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``), its few top-level
tensors spelled as the family's ``HFFormat.unprefixed_names`` say (``published_naming``); its
multi-token-prediction layers ``mtp.{k}.*`` are ``save_pretrained``'s ``model.layers.{n_layers + k}.*``
(``PUBLISHED_DEPTH``): read into a model's prediction depths, those beyond them carried unchanged as a wrapper's
parts are (stored bytes, FP8 and FP4 ones included, named in one line), and exports keep its names and write them
back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from titanctl.models.registry import all_specs, spec_for_hf_model_type

TEXT_PREFIX = "model."  # a *ForCausalLM's decoder
WRAPPED_PREFIX = "model.language_model."  # the same decoder inside a vision-language wrapper
UNPREFIXED = ""  # the same decoder in a published folder without the prefix (DeepSeek-V4's)
PUBLISHED_DEPTH = "mtp."  # an unprefixed folder's prediction depths: mtp.{k}.* (loaded when the model has depth k)
# Parts of a wrapper titanctl does not build (carried unchanged): what each is, for the notes that name them.
NOT_BUILT = {"model.visual.": "the vision encoder", "mtp.": "the multi-token-prediction head"}
NAMING_KEY = "hub_naming"  # in a file layout (formats.hf.file_layout)
# Also in a file layout: the config.json keys of a release whose UE8M0 block scales are carried
# (quantization_config, expert_dtype), written back with its weights in its format (quantized.requantize).
REQUANTIZED_KEY = "requantized"
CARRIED_PART = "hf_carried"  # the DCP entries of the carried tensors: f"{CARRIED_PART}.{stored name}"
TEXT_ONLY_FLAG = "--text-only"
# Keys of the wrapper's text_config that unwrapped_config replaces (kept as the wrapper had them).
_UNWRAPPED_KEYS = ("architectures", "tie_word_embeddings")


@dataclass(frozen=True)
class HubNaming:
    """How a folder spells the text model: its decoder's prefix, whether routed experts are packed
    (a wrapper's are; a plain ``*ForCausalLM`` folder's are written one tensor per expert, as
    ``save_pretrained`` writes them), and a wrapper's config.json around its ``text_config`` (``wrapper_of``)."""

    prefix: str = TEXT_PREFIX
    packed_experts: bool = False
    # An unprefixed folder's top-level tensors: (the *ForCausalLM name, the folder's), where they differ.
    renamed: tuple[tuple[str, str], ...] = ()
    wrapper: dict[str, Any] | None = None

    @property
    def wrapped(self) -> bool:
        return self.prefix == WRAPPED_PREFIX

    @property
    def plain(self) -> bool:
        """Whether this is ``save_pretrained``'s own naming."""
        return self == HubNaming()

    def stored(self, hf_name: str, n_layers: int | None = None) -> str:
        """A ``*ForCausalLM`` name as this folder stores it; an unprefixed folder's prediction depth k
        (``model.layers.{n_layers + k}.*``) as ``mtp.{k}.*``."""
        if self.prefix == UNPREFIXED and n_layers is not None and (depth := _depth_of(hf_name, n_layers)):
            return f"{PUBLISHED_DEPTH}{depth[0]}.{depth[1]}"
        if self.prefix != TEXT_PREFIX:
            renamed = dict(self.renamed)
            if hf_name in renamed:
                return renamed[hf_name]
            if hf_name.startswith(TEXT_PREFIX):
                return self.prefix + hf_name[len(TEXT_PREFIX):]
        return hf_name

    def text_name(self, stored: str, n_layers: int | None = None) -> str:
        """A name this folder stores as the ``*ForCausalLM`` spells it (``stored`` inverted)."""
        if self.prefix == UNPREFIXED and n_layers is not None and \
                (m := re.fullmatch(re.escape(PUBLISHED_DEPTH) + r"(\d+)\.(.+)", stored)):
            return f"{TEXT_PREFIX}layers.{n_layers + int(m.group(1))}.{m.group(2)}"
        if self.prefix == UNPREFIXED:
            theirs = {folder: ours for ours, folder in self.renamed}
            return theirs.get(stored, TEXT_PREFIX + stored if stored.startswith("layers.") else stored)
        return text_name(stored)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefix": self.prefix, "packed_experts": self.packed_experts}
        if self.renamed:
            out["renamed"] = [list(pair) for pair in self.renamed]
        if self.wrapper is not None:
            out["wrapper"] = self.wrapper
        return out

    @classmethod
    def of_layout(cls, layout: Any) -> HubNaming:
        """The naming a file layout records (the default: a plain folder, or a layout without one)."""
        found = layout.get(NAMING_KEY) if isinstance(layout, dict) else None
        if not isinstance(found, dict) or found.get("prefix") not in (WRAPPED_PREFIX, UNPREFIXED):
            return cls()
        if found["prefix"] == WRAPPED_PREFIX:
            wrapper = found.get("wrapper")
            return cls(WRAPPED_PREFIX, found.get("packed_experts") is True,
                       wrapper=wrapper if _is_wrapper(wrapper) else None)
        # An unprefixed folder's renames are a family's own (titanctl.json is read, not trusted to name tensors).
        renamed = found.get("renamed")
        known = [tuple(spec.hf.unprefixed_names.items()) for spec in all_specs() if spec.hf.unprefixed_names]
        pairs = next((names for names in known if isinstance(renamed, list) and [list(p) for p in names] == renamed),
                     None)
        return cls() if pairs is None else cls(UNPREFIXED, False, pairs)

    def wrapped_config(self, text: dict[str, Any]) -> dict[str, Any]:
        """The wrapper's config.json around ``text``, the text model's exported ``*ForCausalLM`` config
        (``carried_config.export_config``): the wrapper's own keys, its text_config's keys that the
        unwrapping replaced as they were, the rest from ``text``; the dtype the text weights are written in."""
        assert self.wrapper is not None
        outer, kept = dict(self.wrapper["config"]), self.wrapper["text_keys"]
        text_config = {key: value for key, value in text.items() if key not in _UNWRAPPED_KEYS}
        outer["text_config"] = {**text_config, **kept}
        for key in ("dtype", "torch_dtype"):
            if key in outer:
                outer[key] = text.get("dtype", text.get("torch_dtype"))
        return outer


def _depth_of(hf_name: str, n_layers: int) -> tuple[int, str] | None:
    """(k, the rest of the name) of a ``*ForCausalLM`` name in prediction depth k (layer n_layers + k)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    return (int(m.group(1)) - n_layers, m.group(2)) if m and int(m.group(1)) >= n_layers else None


def naming_only(layout: Any) -> dict[str, Any] | None:
    """Of a file layout, only its naming and its release's quantization keys (an export into new shards keeps
    the folder's names and format, not its files)."""
    if isinstance(layout, dict) and (NAMING_KEY in layout or REQUANTIZED_KEY in layout):
        return {key: layout[key] for key in (NAMING_KEY, REQUANTIZED_KEY) if key in layout}
    return None


def text_name(stored: str) -> str:
    """A stored tensor name as the text model's ``*ForCausalLM`` spells it."""
    return TEXT_PREFIX + stored[len(WRAPPED_PREFIX):] if stored.startswith(WRAPPED_PREFIX) else stored


def is_wrapped(stored_names: Iterable[str]) -> bool:
    return any(name.startswith(WRAPPED_PREFIX) for name in stored_names)


def published_naming(stored_names: list[str], config: dict[str, Any]) -> HubNaming | None:
    """The naming of a published folder without the ``model.`` prefix, when the family of ``config``'s
    model_type has one (``HFFormat.unprefixed_names``) and the folder's tensors are so named; else None."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    spec = spec_for_hf_model_type(model_type) if isinstance(model_type, str) else None
    if spec is None or not spec.hf.unprefixed_names:
        return None
    if any(name.startswith(TEXT_PREFIX) for name in stored_names) or \
            not any(name.startswith("layers.") for name in stored_names):
        return None
    return HubNaming(UNPREFIXED, renamed=tuple(spec.hf.unprefixed_names.items()))


def not_built(stored: str) -> str | None:
    """The part of a wrapper this tensor belongs to, when titanctl does not build it (else None)."""
    return next((prefix for prefix in NOT_BUILT if stored.startswith(prefix)), None)


def _parts(names: list[str]) -> str:
    """'model.visual.* (2, the vision encoder), mtp.* (2, the multi-token-prediction head)'."""
    counts: dict[str, int] = {}
    for name in names:
        counts[not_built(name)] = counts.get(not_built(name), 0) + 1
    return ", ".join(f"{prefix}* ({n}, {NOT_BUILT[prefix]})" for prefix, n in counts.items())


def carried_note(carried: list[str], config: dict[str, Any]) -> str:
    """One line naming a wrapper's tensors that are carried unchanged, by part, and what an export is."""
    wrapper = (config.get("architectures") or ["the wrapper"])[0]
    text = unwrapped_config(config).get("architectures", ["the *ForCausalLM"])[0]
    return (f"{len(carried)} tensors of the vision-language folder carried unchanged (titanctl builds and trains "
            f"the text model only): {_parts(carried)}; a Hugging Face export writes them back ({wrapper}, under "
            f"the folder's names), {TEXT_ONLY_FLAG} writes the text model alone ({text})")


def left_out_note(left: list[str], architecture: str) -> str:
    """One line naming the carried tensors a text-only export leaves out, by part."""
    return (f"{TEXT_ONLY_FLAG}: {len(left)} tensors of the vision-language folder left out: {_parts(left)}; the "
            f"export is the text model ({architecture}, under the folder's {WRAPPED_PREFIX} names)")


def wrapper_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """What of a vision-language wrapper's config.json an export needs to write it again around the text
    model's: its keys but ``text_config`` (``config``), and the keys of its text_config that
    ``unwrapped_config`` replaces (``text_keys``). None for a config that is no wrapper."""
    text = config.get("text_config")
    if unwrapped_config(config) is config or not isinstance(text, dict):
        return None
    return {"config": {key: value for key, value in config.items() if key != "text_config"},
            "text_keys": {key: text[key] for key in _UNWRAPPED_KEYS if key in text}}


def _is_wrapper(found: Any) -> bool:
    return isinstance(found, dict) and isinstance(found.get("config"), dict) and isinstance(found.get("text_keys"),
                                                                                             dict)


def published_carried_note(carried: list[str]) -> str:
    """One line naming a published folder's tensors carried unchanged, by part."""
    return (f"{len(carried)} tensors of the published folder carried unchanged (titanctl does not build them): "
            f"{_parts(carried)}; a Hugging Face export writes them back under the folder's names")


def unread_note(left: list[str], architecture: str) -> str:
    """One line naming a published folder's tensors that were not read (titanctl does not build them)."""
    return (f"{len(left)} tensors of the published folder left unread, titanctl does not build them: {_parts(left)}; "
            f"an export is the model without them ({architecture}, under the folder's names)")


def unwrapped_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language wrapper's config.json (a ``text_config`` of a family's model_type, under a
    model_type that is none) as its text model's ``*ForCausalLM`` config: the text config, the wrapper's
    tie_word_embeddings (transformers ties the wrapper's lm_head by it), that family's architecture.
    Any other config is returned as it is."""
    text = config.get("text_config")
    outer = config.get("model_type")
    if not isinstance(text, dict) or (isinstance(outer, str) and spec_for_hf_model_type(outer) is not None):
        return config
    inner = text.get("model_type")
    spec = spec_for_hf_model_type(inner) if isinstance(inner, str) else None
    if spec is None:
        return config
    unwrapped = {**text, "architectures": [spec.hf.architecture]}
    if "tie_word_embeddings" in config:
        unwrapped["tie_word_embeddings"] = config["tie_word_embeddings"]
    return unwrapped


__all__ = ["CARRIED_PART", "HubNaming", "NAMING_KEY", "REQUANTIZED_KEY", "TEXT_ONLY_FLAG", "carried_note",
           "is_wrapped", "left_out_note", "naming_only", "not_built", "published_carried_note", "published_naming",
           "text_name", "unread_note", "unwrapped_config", "wrapper_of"]
