"""The Hub's vision-language folders of a text family (Qwen3.5's published checkpoints): the text model read
from under ``model.language_model.``, the parts titanctl does not build named, and the spelling carried to exports.

Qwen/Qwen3.5-35B-A3B and the dense Qwen3.5 releases are ``*ForConditionalGeneration`` folders: config.json
wraps the text model's config in ``text_config`` (beside ``vision_config``), the text weights are
``model.language_model.{embed_tokens,layers.*,norm}`` and ``lm_head``, routed experts are packed
(``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]), and the folder also holds the
vision encoder (``model.visual.*``) and the multi-token-prediction head (``mtp.*``). titanctl builds the text
model: those two are left unread, named in one line. ``HubNaming`` is how the folder spells the text model; it
travels with the folder's file layout (``hf.names.HF_FILES_KEY``), so that an export writes the same names
(``Qwen3_5MoeForCausalLM`` reads them: transformers' conversion mapping strips the prefix, as it does for the
wrapper). Its config.json is the text model's ``*ForCausalLM`` (``unwrapped_config``): a wrapper's config
would ask transformers for a vision encoder the export does not hold.

A family's published folder may also name the decoder without the ``model.`` prefix that ``save_pretrained``
writes (DeepSeek-V4's: ``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``), its few top-level
tensors spelled as the family's ``HFFormat.unprefixed_names`` say (``published_naming``); its
multi-token-prediction layers (``mtp.*``) are left unread, named in one line, and exports keep its names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from titanctl.models.registry import all_specs, spec_for_hf_model_type

TEXT_PREFIX = "model."  # a *ForCausalLM's decoder
WRAPPED_PREFIX = "model.language_model."  # the same decoder inside a vision-language wrapper
UNPREFIXED = ""  # the same decoder in a published folder without the prefix (DeepSeek-V4's)
# Parts of a wrapper titanctl does not build: what each is, for the note that names them.
NOT_BUILT = {"model.visual.": "the vision encoder", "mtp.": "the multi-token-prediction head"}
NAMING_KEY = "hub_naming"  # in a file layout (formats.hf.file_layout)


@dataclass(frozen=True)
class HubNaming:
    """How a folder spells the text model: its decoder's prefix, and whether routed experts are packed
    (a wrapper's are; a plain ``*ForCausalLM`` folder's are written one tensor per expert, as
    ``save_pretrained`` writes them)."""

    prefix: str = TEXT_PREFIX
    packed_experts: bool = False
    # An unprefixed folder's top-level tensors: (the *ForCausalLM name, the folder's), where they differ.
    renamed: tuple[tuple[str, str], ...] = ()

    @property
    def wrapped(self) -> bool:
        return self.prefix == WRAPPED_PREFIX

    @property
    def plain(self) -> bool:
        """Whether this is ``save_pretrained``'s own naming."""
        return self == HubNaming()

    def stored(self, hf_name: str) -> str:
        """A ``*ForCausalLM`` name as this folder stores it."""
        if self.prefix != TEXT_PREFIX:
            renamed = dict(self.renamed)
            if hf_name in renamed:
                return renamed[hf_name]
            if hf_name.startswith(TEXT_PREFIX):
                return self.prefix + hf_name[len(TEXT_PREFIX):]
        return hf_name

    def text_name(self, stored: str) -> str:
        """A name this folder stores as the ``*ForCausalLM`` spells it (``stored`` inverted)."""
        if self.prefix == UNPREFIXED:
            theirs = {folder: ours for ours, folder in self.renamed}
            return theirs.get(stored, TEXT_PREFIX + stored if stored.startswith("layers.") else stored)
        return text_name(stored)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefix": self.prefix, "packed_experts": self.packed_experts}
        if self.renamed:
            out["renamed"] = [list(pair) for pair in self.renamed]
        return out

    @classmethod
    def of_layout(cls, layout: Any) -> HubNaming:
        """The naming a file layout records (the default: a plain folder, or a layout without one)."""
        found = layout.get(NAMING_KEY) if isinstance(layout, dict) else None
        if not isinstance(found, dict) or found.get("prefix") not in (WRAPPED_PREFIX, UNPREFIXED):
            return cls()
        if found["prefix"] == WRAPPED_PREFIX:
            return cls(WRAPPED_PREFIX, found.get("packed_experts") is True)
        # An unprefixed folder's renames are a family's own (titanctl.json is read, not trusted to name tensors).
        renamed = found.get("renamed")
        known = [tuple(spec.hf.unprefixed_names.items()) for spec in all_specs() if spec.hf.unprefixed_names]
        pairs = next((names for names in known if isinstance(renamed, list) and [list(p) for p in names] == renamed),
                     None)
        return cls() if pairs is None else cls(UNPREFIXED, False, pairs)


def naming_only(layout: Any) -> dict[str, Any] | None:
    """Of a file layout, only its naming (an export into new shards keeps the folder's names, not its files)."""
    if isinstance(layout, dict) and NAMING_KEY in layout:
        return {NAMING_KEY: layout[NAMING_KEY]}
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


def left_out_note(left: list[str], architecture: str, naming: HubNaming | None = None) -> str:
    """One line naming a wrapper's (or a published folder's) tensors that were not read, by part, and why."""
    counts: dict[str, int] = {}
    for name in left:
        counts[not_built(name)] = counts.get(not_built(name), 0) + 1
    parts = ", ".join(f"{prefix}* ({n}, {NOT_BUILT[prefix]})" for prefix, n in counts.items())
    if naming is not None and naming.prefix == UNPREFIXED:
        return (f"{len(left)} tensors of the published folder left unread, titanctl does not build them: {parts}; "
                f"an export is the model without them ({architecture}, under the folder's names)")
    return (f"{len(left)} tensors of the vision-language folder left unread, titanctl builds the text model only: "
            f"{parts}; an export is that text model ({architecture}, under the folder's {WRAPPED_PREFIX} names)")


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


__all__ = ["HubNaming", "NAMING_KEY", "is_wrapped", "left_out_note", "naming_only", "not_built", "published_naming",
           "text_name", "unwrapped_config"]
