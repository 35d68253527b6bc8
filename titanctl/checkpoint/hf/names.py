"""Hugging Face ``*ForCausalLM`` <-> titanctl names, weights and config, for every family
(the names and config keys come from the family's spec).

Pure functions, no ``transformers`` import. Conversion is one tensor at a time
(``to_hf_tensor`` / ``from_hf_tensor``), so a converter can stream a 70B checkpoint
through it; ``iter_to_hf`` / ``iter_from_hf`` add the completeness checks over a
stream, and the ``*_state_dict`` functions are the same over a dict.

Two things are more than renames. Meta's RoPE rotates interleaved channel pairs ``(2i, 2i+1)`` of a head,
Hugging Face's rotates halves ``(i, i + head_dim/2)``: for a model in Meta's layout (Llama) the output rows of
``wq`` and ``wk`` are permuted within each head (``wk`` with the KV head count); a family may reorder other
rows its own way (``HFFormat.reordered_rows``). And routed experts, stacked ``[E, ...]`` in titanctl, are
written one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ...) as ``save_pretrained``, the Hub's
checkpoints, vLLM, SGLang and transformers 4.x have them; reading also takes transformers 5's packed
``mlp.experts.gate_up_proj`` / ``down_proj`` (its in-memory layout). A tied output layer is the embedding
table: Hugging Face writes only the embedding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from titanctl.checkpoint.hf.hub_layout import HubNaming, unwrapped_config
from titanctl.checkpoint.trust.model_args import check_args
from titanctl.checkpoint.trust.shape_inference import kv_heads_hint
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs, spec_for_hf_model_type, spec_of
from titanctl.models.shapes import tied_weights, weight_shapes
from titanctl.models.spec import HFFormat

Pairs = Iterable[tuple[str, torch.Tensor]]  # (name, tensor), e.g. read one by one from safetensors

_CANONICAL_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_CANONICAL_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
# Derived buffers that old transformers versions saved; they carry no weights.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)

HF_FILES_KEY = "hf_files"  # a Hugging Face source's files, carried to its exports (formats.hf.file_layout)


# ----------------------------------------------------------------------------- names


def _hf_of(name: str, hf: HFFormat, n_layers: int | None = None) -> str | None:
    """``n_layers``: the main model's depth, after which the prediction depths' layers come (None:
    no names of prediction depths)."""
    if name in hf.top_names:
        return hf.top_names[name]
    m = _CANONICAL_LAYER.fullmatch(name)
    if m and m.group(2) in hf.layer_names:
        return f"model.layers.{m.group(1)}.{hf.layer_names[m.group(2)]}"
    m = _CANONICAL_MTP.fullmatch(name)
    if m and n_layers is not None and m.group(2) in hf.mtp_names:
        return f"model.layers.{n_layers + int(m.group(1))}.{hf.mtp_names[m.group(2)]}"
    return None


def _canonical_of(hf_name: str, hf: HFFormat, n_layers: int | None = None) -> str | None:
    for ours, theirs in hf.top_names.items():
        if theirs == hf_name:
            return ours
    m = _HF_LAYER.fullmatch(hf_name)
    if m:
        for ours, theirs in hf.layer_names.items():
            if theirs == m.group(2):
                return f"layers.{m.group(1)}.{ours}"
        if n_layers is not None and int(m.group(1)) >= n_layers:
            for ours, theirs in hf.mtp_names.items():
                if theirs == m.group(2):
                    return f"mtp.{int(m.group(1)) - n_layers}.{ours}"
    return None


def canonical_name(hf_name: str, args: ModelArgs) -> str | None:
    """The titanctl name of a Hugging Face weight name in the model's family (None: not one of its names)."""
    return _canonical_of(hf_name, spec_of(args).hf, args.n_layers)


def shared_copy(hf_name: str, args: ModelArgs) -> bool:
    """Whether a Hugging Face tensor is a prediction depth's copy of a weight the main model holds
    (DeepSeek-V3's ``model.layers.{n}.embed_tokens`` / ``shared_head.head``): not read."""
    m = _HF_LAYER.fullmatch(hf_name)
    return m is not None and int(m.group(1)) >= args.n_layers and m.group(2) in spec_of(args).hf.mtp_shared


def _hf_name(name: str, args: ModelArgs) -> str:
    hf = _hf_of(name, spec_of(args).hf, args.n_layers)
    if hf is None or name not in weight_shapes(args):
        raise CheckpointError(f"unknown titanctl tensor {name!r} (not a {args.family} weight of this model)")
    return hf


def _canonical_name(name: str, args: ModelArgs) -> str:
    hf = spec_of(args).hf
    ours = _canonical_of(name, hf, args.n_layers)
    if ours is None or ours not in weight_shapes(args):
        raise CheckpointError(
            f"unknown Hugging Face tensor {name!r} (not a {hf.architecture} weight of this model)"
        )
    return ours


def canonical_name_of(hf_name: str) -> str | None:
    """The titanctl name of a Hugging Face weight name of any family, whatever the model's depth
    (None: no family's weight name)."""
    return next((ours for spec in all_specs() if (ours := _canonical_of(hf_name, spec.hf)) is not None), None)


# ----------------------------------------------------------------------------- experts: one tensor each, or packed


@dataclass(frozen=True)
class Piece:
    """A titanctl weight's share of one Hugging Face tensor that is not simply renamed: expert
    ``expert``'s matrix of a weight stacked over experts (the Hub's one tensor per expert), or slice
    ``index`` of ``parts`` equal slices along ``dim`` of a packed tensor (transformers 5's in-memory
    ``mlp.experts.gate_up_proj``, which some folders hold; read only)."""

    name: str  # the titanctl weight
    dim: int = 0
    index: int = 0
    parts: int = 1
    expert: int | None = None  # with parts > 1: slice ``index`` along dim 0 of that expert's matrix


def structured_pieces(hf_name: str, args: ModelArgs) -> list[Piece]:
    """The titanctl weights a packed or per-expert Hugging Face tensor holds ([] for any other)."""
    spec = spec_of(args).hf
    m = _HF_LAYER.fullmatch(hf_name)
    if m is None or int(m.group(1)) >= args.n_layers + args.mtp_layers:
        return []
    layer, suffix = m.groups()
    pieces = [Piece(f"layers.{layer}.{ours}", dim, index, parts)
              for ours, (theirs, dim, index, parts) in spec.packed.items() if theirs == suffix]
    for ours, found in spec.per_expert.items():
        templates = expert_templates(found)
        for index, template in enumerate(templates):
            e = re.fullmatch(re.escape(template).replace(r"\{e\}", r"(\d+)"), suffix)
            if e and int(e.group(1)) < args.moe.num_experts:
                pieces.append(Piece(f"layers.{layer}.{ours}", 0, index, len(templates), expert=int(e.group(1))))
    return pieces


def expert_templates(per_expert: str | tuple[str, ...]) -> tuple[str, ...]:
    """An ``HFFormat.per_expert`` value as its templates: one, or several whose tensors stack along dim 0
    into the expert's matrix (DeepSeek-V4's w1 and w3 rows make titanctl's gate_up_proj)."""
    return (per_expert,) if isinstance(per_expert, str) else tuple(per_expert)


def _expert_template(name: str, args: ModelArgs) -> tuple[str, tuple[str, ...]] | None:
    m = _CANONICAL_LAYER.fullmatch(name)
    template = spec_of(args).hf.per_expert.get(m.group(2)) if m else None
    return None if template is None else (m.group(1), expert_templates(template))


def stacked_over_experts(name: str, args: ModelArgs) -> bool:
    """Whether Hugging Face stores this titanctl weight as one tensor per expert."""
    return _expert_template(name, args) is not None


def per_expert_tensors(name: str, stack: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """A weight stacked over experts under the Hub's names (``mlp.experts.{e}.gate_proj.weight``, ...):
    one (name, matrix) per expert and template, each a view of ``stack``."""
    layer, templates = _expert_template(name, args)
    return [(f"model.layers.{layer}.{template.format(e=e)}", part)
            for e in range(stack.shape[0])
            for template, part in zip(templates, stack[e].chunk(len(templates), dim=0), strict=True)]


def expert_layout(hf_name: str, args: ModelArgs) -> str | None:
    """How a Hugging Face tensor stores routed experts: "one tensor per expert", "packed" (every
    expert in one tensor), or None for a tensor that is no routed expert's."""
    pieces = structured_pieces(hf_name, args)
    if pieces:
        return "packed" if pieces[0].expert is None else "one tensor per expert"
    ours = _canonical_of(hf_name, spec_of(args).hf, args.n_layers)
    return "packed" if ours is not None and stacked_over_experts(ours, args) else None


def check_one_expert_layout(hf_names: Iterable[str], args: ModelArgs) -> None:
    """A one-line CheckpointError when a layer stores its experts both packed and one tensor per
    expert (which of the two to read is not the reader's to guess)."""
    seen: dict[str, dict[str, str]] = {}  # HF layer prefix -> {layout: first tensor seen}
    for hf_name in hf_names:
        layout = expert_layout(hf_name, args)
        if layout is None:
            continue
        layer = _HF_LAYER.fullmatch(hf_name).group(1)
        layouts = seen.setdefault(layer, {})
        layouts.setdefault(layout, hf_name)
        if len(layouts) == 2:
            raise CheckpointError(
                f"layer {layer} stores its experts in two layouts, packed ({layouts['packed']!r}) and one tensor "
                f"per expert ({layouts['one tensor per expert']!r}): a checkpoint holds one of them"
            )


def not_stored(name: str, args: ModelArgs) -> bool:
    """Whether Hugging Face's format of the family leaves this titanctl state out (it reads as zeros)."""
    m = _CANONICAL_LAYER.fullmatch(name)
    return m is not None and m.group(2) in spec_of(args).hf.not_stored


def hf_names_of(name: str, args: ModelArgs) -> list[str]:
    """The Hugging Face tensors a titanctl weight is written as: one per expert for routed experts
    (as ``save_pretrained`` and the Hub store them), else its one renamed tensor; [] for state the
    format does not store."""
    if not_stored(name, args):
        return []
    template = _expert_template(name, args)
    if template is not None:
        layer, suffixes = template
        return [f"model.layers.{layer}.{suffix.format(e=e)}" for e in range(args.moe.num_experts)
                for suffix in suffixes]
    return [_hf_name(name, args)]


def _shown_hf_name(name: str, args: ModelArgs) -> str:
    """One name for messages: a weight stored per expert as its name template (``experts.{e}.``)."""
    template = _expert_template(name, args)
    return " + ".join(f"model.layers.{template[0]}.{t}" for t in template[1]) if template else _hf_name(name, args)


def transposed(canonical: str, args: ModelArgs) -> bool:
    """Whether Hugging Face's tensor of this titanctl weight holds its last two dimensions swapped."""
    m = _CANONICAL_LAYER.fullmatch(canonical)
    return m is not None and m.group(2) in spec_of(args).hf.transposed


def _check_shape(canonical: str, shown_name: str, tensor: torch.Tensor, args: ModelArgs) -> None:
    """``tensor`` in titanctl's layout has the shape of ``canonical``; the message names the shapes of
    ``shown_name`` (a Hugging Face tensor of a transposed weight: its own order)."""
    expected = weight_shapes(args)[canonical]
    if tuple(tensor.shape) != expected:
        if shown_name != canonical and transposed(canonical, args):
            raise CheckpointError(f"tensor {shown_name!r} has shape {tuple(tensor.mT.shape)}, expected "
                                  f"{(*expected[:-2], expected[-1], expected[-2])} for this model")
        raise CheckpointError(
            f"tensor {shown_name!r} has shape {tuple(tensor.shape)}, expected {expected} for this model"
            f"{kv_heads_hint(canonical, tuple(tensor.shape), expected, args)}"
        )


# ----------------------------------------------------------------------------- rotary permutation


def _heads_of(canonical: str, args: ModelArgs) -> int | None:
    """Query or key heads whose rows to permute: only Meta's interleaved RoPE layout needs it (not
    MLA's: transformers' DeepSeek-V3 rotates interleaved pairs too)."""
    if args.rope_layout != "interleaved" or args.mla is not None:
        return None
    if canonical.endswith("attention.wq.weight"):
        return args.n_heads
    if canonical.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head: Meta's (pair, 2) order -> HF's (2, pair) order."""
    rows, cols = w.shape
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, pairs, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, 2, pairs, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- tensors


def _reorder_rows(canonical: str, rows: torch.Tensor, args: ModelArgs, to_hf: bool) -> torch.Tensor:
    """``rows`` (dim 0 of the weight ``canonical`` or of its LoRA B factor) in the other side's order:
    Meta's RoPE layout's q/k permute, or the family's own ``reordered_rows``."""
    m = _CANONICAL_LAYER.fullmatch(canonical)
    reorder = spec_of(args).hf.reordered_rows.get(m.group(2)) if m is not None else None
    if reorder is not None:
        return reorder[0 if to_hf else 1](rows, args)
    heads = _heads_of(canonical, args)
    if heads is None:
        return rows
    return _interleaved_to_halves(rows, heads) if to_hf else _halves_to_interleaved(rows, heads)


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One titanctl weight (canonical name) -> its Hugging Face name and layout. Dtype is kept."""
    hf = _hf_name(name, args)
    _check_shape(name, name, tensor, args)
    if transposed(name, args):
        return hf, tensor.mT  # a view: the writer makes it contiguous
    return hf, _reorder_rows(name, tensor, args, to_hf=True)


def from_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One Hugging Face weight -> its titanctl (Meta) name and layout. Dtype is kept (a transposed
    weight comes back as a view of ``tensor``)."""
    canonical = _canonical_name(name, args)
    if transposed(canonical, args):
        tensor = tensor.mT
    _check_shape(canonical, name, tensor, args)
    return canonical, _reorder_rows(canonical, tensor, args, to_hf=False)


def to_hf_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """One titanctl weight -> the Hugging Face tensors that store it (names and layout; dtype kept):
    its renamed tensor, one matrix per expert for routed experts, none for state the format does
    not store."""
    if not_stored(name, args):
        return []
    if stacked_over_experts(name, args):
        _check_shape(name, name, tensor, args)
        return per_expert_tensors(name, tensor, args)
    return [to_hf_tensor(name, tensor, args)]


def _packed_piece(name: str, args: ModelArgs) -> tuple[str, int, int, int] | None:
    """(HF name, dim, index, parts) of a titanctl weight that is a slice of a packed Hugging Face tensor."""
    m = _CANONICAL_LAYER.fullmatch(name)
    packed = spec_of(args).hf.packed.get(m.group(2)) if m else None
    if packed is None:
        return None
    theirs, dim, index, parts = packed
    return f"model.layers.{m.group(1)}.{theirs}", dim, index, parts


def hub_names_of(name: str, args: ModelArgs, naming: HubNaming) -> list[tuple[str, tuple[int, int, int] | None]]:
    """``hf_names_of`` as a folder of ``naming`` stores them: each Hugging Face tensor with (dim, index,
    parts) when the weight is that slice of it (packed experts), else None."""
    if naming.packed_experts and not not_stored(name, args):
        piece = _packed_piece(name, args)
        if piece is not None:
            return [(naming.stored(piece[0], args.n_layers), piece[1:])]
        if stacked_over_experts(name, args):  # packed as titanctl holds it (down_proj [E, D, F])
            return [(naming.stored(_hf_name(name, args), args.n_layers), None)]
    return [(naming.stored(hf, args.n_layers), None) for hf in hf_names_of(name, args)]


def to_hub_tensors(name: str, tensor: torch.Tensor, args: ModelArgs, naming: HubNaming) -> dict[str, torch.Tensor]:
    """``to_hf_tensors`` as a folder of ``naming`` stores them; a weight that is a slice of a packed tensor
    comes as itself, under the packed tensor's name (the writer joins the slices)."""
    if naming.packed_experts and not not_stored(name, args):
        if _packed_piece(name, args) is not None:
            _check_shape(name, name, tensor, args)
            return {hub_names_of(name, args, naming)[0][0]: tensor}
        if stacked_over_experts(name, args):
            hf, out = to_hf_tensor(name, tensor, args)
            return {naming.stored(hf, args.n_layers): out}
    return {naming.stored(hf, args.n_layers): t for hf, t in to_hf_tensors(name, tensor, args)}


def to_hf_rows(name: str, rows: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """A tensor whose rows are those of the titanctl weight ``name`` (a LoRA adapter's B factor,
    (out, rank)): the weight's Hugging Face name, and the rows in Hugging Face's order (q/k rows
    permuted for Meta's RoPE layout, as the weight's are). Dtype is kept."""
    return _hf_name(name, args), _reorder_rows(name, rows, args, to_hf=True)


def from_hf_rows(hf_name: str, rows: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """``to_hf_rows`` inverted: rows in the Hugging Face weight ``hf_name``'s order (a peft adapter's
    lora_B, (out, rank)) -> the titanctl weight's name and the rows in its order. Dtype is kept."""
    canonical = _canonical_name(hf_name, args)
    return canonical, _reorder_rows(canonical, rows, args, to_hf=False)


def _convert_stream(pairs: Pairs, args: ModelArgs, to_hf: bool, complete: bool) -> Iterator[tuple[str, torch.Tensor]]:
    aliases = tied_weights(args)  # a tied output layer is the embedding: Hugging Face stores it once
    missing = {name for name in weight_shapes(args) if name not in aliases and (to_hf or not not_stored(name, args))}
    for name, tensor in pairs:
        if not to_hf and (name.endswith(IGNORED_HF_SUFFIXES) or shared_copy(name, args)):
            continue
        if (name if to_hf else _canonical_name(name, args)) in aliases:
            continue
        converted = to_hf_tensors(name, tensor, args) if to_hf else [from_hf_tensor(name, tensor, args)]
        canonical = name if to_hf else converted[0][0]
        if canonical not in missing:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        missing.discard(canonical)
        yield from converted
    if missing and complete:
        names = sorted(missing if to_hf else (_shown_hf_name(m, args) for m in missing))
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(names[:3])}{more}")


def iter_to_hf(pairs: Pairs, args: ModelArgs, complete: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs of titanctl weights out as Hugging Face's (``to_hf_tensors``);
    raises at the end if a weight never came (``complete``)."""
    return _convert_stream(pairs, args, to_hf=True, complete=complete)


def iter_from_hf(pairs: Pairs, args: ModelArgs, complete: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream Hugging Face (name, tensor) pairs of renamed weights to titanctl; raises at the end if
    a weight never came (``complete``)."""
    return _convert_stream(pairs, args, to_hf=False, complete=complete)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanctl weights under Hugging Face names and layouts, as ``save_pretrained`` writes them:
    routed experts one tensor per expert (views of the stack), a tied output layer left out."""
    return dict(iter_to_hf(sd.items(), args))


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every key ``load_state_dict`` wants, a tied alias included (as the embedding's tensor), and
    state the format does not store as zeros. Experts may come one tensor per expert or packed
    (transformers 5's in-memory state dict), not both."""
    check_one_expert_layout(sd, args)
    plain, stacks = {}, {}
    for key, tensor in sd.items():
        pieces = structured_pieces(key, args)
        if not pieces:
            plain[key] = tensor
        for piece in pieces:
            if piece.expert is not None:
                stacks.setdefault(piece.name, {}).setdefault(piece.expert, {})[piece.index] = (tensor, piece.parts)
            else:
                size = tensor.shape[piece.dim] // piece.parts
                stacks.setdefault(piece.name, {})[None] = tensor.narrow(piece.dim, piece.index * size, size)
    out = dict(iter_from_hf(plain.items(), args, complete=False))
    for name, by_expert in stacks.items():
        if None in by_expert:
            out[name] = by_expert[None]
        elif sorted(by_expert) == list(range(args.moe.num_experts)) and all(
                sorted(parts) == list(range(next(iter(parts.values()))[1])) for parts in by_expert.values()):
            out[name] = torch.stack([torch.cat([by_expert[e][i][0] for i in sorted(by_expert[e])])
                                     for e in sorted(by_expert)])
    shapes = weight_shapes(args)
    for name in shapes:
        if not_stored(name, args):
            out[name] = torch.zeros(shapes[name])
    for alias, of in tied_weights(args).items():
        out[alias] = out[of]
    missing = [name for name in shapes if name not in out]
    if missing:
        names = sorted(_shown_hf_name(name, args) for name in missing)
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(names[:3])}{more}")
    return out


# ----------------------------------------------------------------------------- config


def hf_config(
    args: ModelArgs,
    *,
    torch_dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json of the family's ``*ForCausalLM`` that transformers 4.x and 5.x both read."""
    config = spec_of(args).hf.config_from_args(args, max_position_embeddings)
    return {
        **config,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,  # 4.x name
        "dtype": torch_dtype,  # 5.x name
    }


def args_from_hf_config(
    cfg: dict[str, Any], *, max_seq_len: int | None = None, where: str = "the Hugging Face config"
) -> ModelArgs:
    """ModelArgs of a Hugging Face ``*ForCausalLM`` config (4.x or 5.x keys) of any family, whose
    ``model_type`` picks the family, checked (``titanctl.checkpoint.trust.model_args.check_args``).

    ``max_seq_len`` (the RoPE table length; the trainer sets its own) defaults to
    ``max_position_embeddings``. A vision-language wrapper's config (the Hub's Qwen3.5) is read as its
    text model's (``hub_layout.unwrapped_config``).
    """
    cfg = unwrapped_config(cfg)
    model_type = cfg.get("model_type", "llama")
    spec = spec_for_hf_model_type(model_type) if isinstance(model_type, str) else None
    if spec is None:
        known = ", ".join(s.hf.model_type for s in all_specs())
        raise CheckpointError(f"{where}: model_type {model_type!r} is no family titanctl builds ({known})")
    try:
        args = spec.hf.args_from_config(cfg, max_seq_len, where)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise CheckpointError(f"{where} has an invalid value: {e}") from None
    return check_args(args, where)


__all__ = [
    "args_from_hf_config",
    "canonical_name_of",
    "check_one_expert_layout",
    "shared_copy",
    "from_hf_state_dict",
    "from_hf_tensor",
    "hf_config",
    "hf_names_of",
    "iter_from_hf",
    "iter_to_hf",
    "per_expert_tensors",
    "stacked_over_experts",
    "to_hf_state_dict",
    "to_hf_tensor",
    "to_hf_rows",
    "to_hf_tensors",
]


def special_token_ids(args: ModelArgs) -> tuple[int | None, int | None]:
    """bos/eos ids that the family's convention derives from the vocabulary (Llama 3's: the 256
    specials come last); (None, None) for a family without one (the tokenizer, when exported, says)."""
    return spec_of(args).hf.special_ids(args.vocab_size)
