"""A LoRA checkpoint's adapters out of titanctl: as peft's adapter folder, or merged into the base.

A LoRA run's step folder holds the adapters (``layers.0.attention.wq.lora_a`` ...) and records in its
``titanctl.json`` under ``lora`` their rank, alpha, dropout and targets, and the base they were
trained on (``titanctl.checkpoint.lora.base``).

``--to peft`` writes what ``PeftModel.from_pretrained(base, folder)`` loads onto the base transformers
model: ``adapter_config.json`` (rank, alpha, dropout, the Hugging Face names of the adapted modules)
and ``adapter_model.safetensors`` under peft's names (``base_model.model.{module}.lora_A.weight``, B
likewise). A's columns and B's rows follow the Hugging Face weight's layout: for Llama (Meta's RoPE
layout inside titanctl) the rows of B on ``q_proj``/``k_proj`` are permuted as the weight's are.
Routed experts, which transformers 5 holds packed (``mlp.experts.gate_up_proj`` [E, 2F, D],
``down_proj`` [E, D, F]), are peft ``target_parameters``: the gate's and up's adapters share one
packed adapter of twice the rank (A stacked, B block-diagonal), the same product; of the rank itself
when the two share their A (as a peft-made adapter read by ``titanctl.checkpoint.lora.peft_import`` does).

``--merge-lora`` gives a ``Source`` of the merged model, ``W + (alpha / rank) B A`` per adapted weight
(per expert for a stack), computed in float32 and cast back to the base's dtype, that any format's
writer takes; the model's saved buffers (an MoE's expert bias, which balancing moves while the base is
frozen) are the step's. peft has no slot for such a bias: ``--to peft`` of a step whose bias moved is
refused unless ``--drop-expert-bias`` (``titanctl.checkpoint.hf.uncarried``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titanctl.checkpoint.formats.base import Source
from titanctl.checkpoint.hf.names import to_hf_rows
from titanctl.checkpoint.locate import PEFT_ADAPTER_CONFIG
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.parallel.converters.lora import adapter_names

PEFT_CONFIG = PEFT_ADAPTER_CONFIG
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# peft 0.21 attaches target_parameters to transformers 5's packed experts; transformers 4.57 holds them per
# expert, where peft matches no parameter (it warns) and attaches the attention adapters alone.
EXPERT_ADAPTERS_NOTE = ("the expert adapters are peft target_parameters on transformers 5's packed experts: they "
                        "load with transformers 5.x; transformers 4.x attaches only the other adapters (peft warns "
                        "that no parameter was matched)")
# titanctl's expert stacks -> transformers 5's packed expert parameter, and the slot in it.
PACKED_EXPERTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}


def peft_adapter(adapters: dict[str, torch.Tensor], args: ModelArgs, record: dict[str, Any],
                 base_path: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, {peft name: tensor}) of the adapters ``record`` describes."""
    rank, alpha = int(record["rank"]), float(record["alpha"])
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    stacks: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # HF experts module -> {w: (A, B)}
    for target, kind in record["targets"].items():
        a, b = (adapters[name] for name in adapter_names(target, kind))
        if kind == "experts":
            layer_module, _, weight = target.rpartition(".")
            hf_module = hf_experts_module(layer_module, args)
            stacks.setdefault(hf_module, {})[weight] = (a, b)
            continue
        if target.endswith("router.gate") and args.moe is not None:
            raise CheckpointError(
                f"peft cannot hold the adapter on {target}: transformers' MoE router is no linear layer; "
                "export the merged model instead (--to hf --merge-lora)"
            )
        hf_name, b_hf = to_hf_rows(f"{target}.weight", b, args)
        module = hf_name.removesuffix(".weight")
        modules.append(module)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_hf.contiguous()
    parameters, rank_pattern = [], {}
    for hf_module, by_weight in stacks.items():
        packed = _packed_experts(by_weight, rank)
        # peft nests one wrapper per targeted parameter of a module, the first listed innermost:
        # its tensors then sit under one more "base_layer." per wrapper around it.
        order = [p for p in ("gate_up_proj", "down_proj") if p in packed]
        for depth, param in enumerate(order):
            a, b, r = packed[param]
            inner = "base_layer." * (len(order) - 1 - depth)
            tensors[f"{PEFT_PREFIX}{hf_module}.{inner}lora_A.weight"] = a
            tensors[f"{PEFT_PREFIX}{hf_module}.{inner}lora_B.weight"] = b
            parameters.append(f"{hf_module}.{param}")
            if r != rank:
                rank_pattern[f"{hf_module}.{param}"] = r
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": float(record.get("dropout", 0.0)),
        "target_modules": sorted(modules) or None,
        "target_parameters": parameters or None,
        # A packed gate/up adapter has twice the rank: the same alpha / rank scale needs twice the alpha.
        "rank_pattern": rank_pattern,
        "alpha_pattern": {key: alpha * r / rank for key, r in rank_pattern.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return config, tensors


def hf_experts_module(layer_module: str, args: ModelArgs) -> str:
    """``layers.{i}.moe.experts`` -> ``model.layers.{i}.mlp.experts`` (transformers' packed experts)."""
    from titanctl.checkpoint.hf.names import hf_names_of

    first = hf_names_of(f"{layer_module}.w1", args)[0]  # model.layers.{i}.mlp.experts.0.gate_proj.weight
    return first.rsplit(".", 3)[0]


def _packed_experts(by_weight: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int) -> dict:
    """{packed parameter: (peft lora_A.weight, lora_B.weight, its rank)} for transformers 5's experts.

    peft's ``ParamWrapper`` on a parameter [E, out, in] has lora_A.weight [E * r, in] (expert-major
    rows) and lora_B.weight [out, r * E] (column k * E + e: rank-major), and adds per expert
    ``scale * B_e A_e``. gate_up_proj stacks the gate's rows over the up's: its adapter of rank 2r
    stacks their A's and puts their B's on the block diagonal, so it adds both and nothing else. When
    the gate's and the up's A are one (a peft adapter of rank r read in), it is of rank r: A, and B the
    gate's rows over the up's.
    """
    out = {}
    for param in ("gate_up_proj", "down_proj"):
        slots = {w: slot for w, (p, slot) in PACKED_EXPERTS.items() if p == param}
        present = {w: by_weight[w] for w in slots if w in by_weight}
        if not present:
            continue
        some_a, some_b = next(iter(present.values()))
        experts, in_dim = some_a.shape[0], some_a.shape[2]
        out_rows = some_b.shape[1]
        parts = len(slots)  # gate_up_proj: gate then up
        if len(present) == parts > 1 and all(torch.equal(a, some_a) for a, _ in present.values()):
            b = torch.cat([present[w][1] for w in sorted(slots, key=slots.get)], dim=1)  # (E, 2F, r)
            out[param] = (some_a.reshape(experts * rank, in_dim).contiguous(),
                          b.permute(1, 2, 0).reshape(out_rows * parts, rank * experts).contiguous(), rank)
            continue
        r = rank * parts
        a = torch.zeros(experts, r, in_dim, dtype=some_a.dtype)
        b = torch.zeros(experts, out_rows * parts, r, dtype=some_b.dtype)
        for w, slot in slots.items():
            if w in present:
                wa, wb = present[w]
                a[:, slot * rank:(slot + 1) * rank] = wa
                b[:, slot * out_rows:(slot + 1) * out_rows, slot * rank:(slot + 1) * rank] = wb
        out[param] = (a.reshape(experts * r, in_dim).contiguous(),
                      b.permute(1, 2, 0).reshape(out_rows * parts, r * experts).contiguous(), r)
    return out


@dataclasses.dataclass
class LoRAStep:
    """What a LoRA step folder holds of the model: its adapters, and the model's saved buffers."""

    meta: dict[str, Any]  # titanctl.json
    record: dict[str, Any]  # its checked ``lora`` entry
    adapters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]  # e.g. an MoE's expert bias, as the run left it


def read_lora_step(folder: Path) -> LoRAStep:
    """A LoRA step folder's model tensors, its files verified against their checksums first. A
    CheckpointError for a folder without adapters."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanctl.checkpoint.formats.dcp import TRAINING_STATE
    from titanctl.checkpoint.lora.base import read_record
    from titanctl.checkpoint.trust.reader import DCPFolder, quiet_dcp
    from titanctl.parallel.converters.lora import is_adapter

    reader = DCPFolder(folder)
    record = read_record(reader.meta, folder)
    if record is None:
        raise CheckpointError(f"{folder} holds no LoRA adapters (its titanctl.json has no 'lora' entry)")
    reader.verify()
    tensors = {name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for name, entry in reader.entries.items()
               if isinstance(entry, TensorStorageMetadata) and name.split(".", 1)[0] not in TRAINING_STATE}
    adapters = {name: t for name, t in tensors.items() if is_adapter(name)}
    expected = {n for target, kind in record["targets"].items() for n in adapter_names(target, kind)}
    if set(adapters) != expected:
        odd = sorted(set(adapters) ^ expected)
        raise CheckpointError(f"{folder}: its adapters do not match the targets its titanctl.json records ({odd[0]})")
    for target, kind in record["targets"].items():  # A (r, in) and B (out, r), per expert for a stack
        a, b = (tensors[n] for n in adapter_names(target, kind))
        if a.shape[-2] != record["rank"] or b.shape[-1] != record["rank"]:
            raise CheckpointError(f"{folder}/titanctl.json records LoRA rank {record['rank']:,}, but the adapters of "
                                  f"{target} have rank {a.shape[-2]} (A {tuple(a.shape)}, B {tuple(b.shape)})")
    with quiet_dcp():
        reader.load(tensors)
    buffers = {name: t for name, t in tensors.items() if name not in adapters}
    return LoRAStep(reader.meta, record, adapters, buffers)


def read_adapters(folder: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(titanctl.json, its checked ``lora`` entry, {adapter name: tensor}) of a LoRA step folder."""
    step = read_lora_step(folder)
    return step.meta, step.record, step.adapters


def write_peft(folder: Path, adapters: dict[str, torch.Tensor], args: ModelArgs, record: dict[str, Any],
               base_path: str | None, dtype: torch.dtype | None = None) -> list[str]:
    """peft's adapter folder (``PEFT_CONFIG``, ``PEFT_WEIGHTS``) into ``folder`` (made already)."""
    config, tensors = peft_adapter(adapters, args, record, base_path)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [PEFT_CONFIG, PEFT_WEIGHTS]


class MergedSource(Source):
    """A bound base source with the adapters folded in: W + (alpha / rank) B A, in float32, cast back
    to the base tensor's dtype (per expert for a stack); the step's ``buffers`` in place of the base's."""

    format = "dcp"

    def __init__(self, base: Source, adapters: dict[str, torch.Tensor], record: dict[str, Any], folder: Path,
                 meta: dict[str, Any], buffers: dict[str, torch.Tensor] | None = None) -> None:
        # Seen as the LoRA step (``folder``, its titanctl.json ``meta``): its tokenizer, step and carried
        # Hugging Face config are the export's.
        super().__init__(folder)
        self.meta = meta
        self.base, self.origin, self.notes = base, base.origin, base.notes
        self.args, self.infos = base.args, base.infos
        self.carried = base.carried  # a vision-language base's other parts: LoRA adapts the text model only
        self.scale = float(record["alpha"]) / int(record["rank"])
        self.merges = {f"{target}.weight" if kind == "linear" else target: adapter_names(target, kind)
                       for target, kind in record["targets"].items()}
        self.adapters = adapters
        self.buffers = buffers or {}
        missing = [name for name in [*self.merges, *self.buffers] if name not in {info.name for info in base.infos}]
        if missing:
            raise CheckpointError(f"the base {base.folder} has no tensor {missing[0]}, which {folder} holds")

    def own_args(self) -> tuple[ModelArgs | None, str]:
        return self.args, self.origin

    def vocab_size(self, dim: int) -> int:
        return self.base.vocab_size(dim)

    def bind(self, args: ModelArgs, origin: str) -> None:
        raise TypeError("a MergedSource is made of a bound source")

    def load(self, name: str) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name]
        weight = self.base.load(name)
        pair = self.merges.get(name)
        if pair is None:
            return weight
        a, b = (self.adapters[n].float() for n in pair)
        merged = weight.float() + (b @ a) * self.scale  # (out, r) @ (r, in), or batched over experts
        return merged.to(weight.dtype)

    def load_carried(self, name: str) -> torch.Tensor:
        return self.base.load_carried(name)

    def extra_metadata(self) -> dict[str, Any]:
        from titanctl.checkpoint.hf.carried_config import HF_CONFIG_KEY
        from titanctl.checkpoint.hf.names import HF_FILES_KEY

        kinds = {"step": int, HF_CONFIG_KEY: dict, HF_FILES_KEY: dict}
        return {key: self.meta[key] for key, kind in kinds.items() if isinstance(self.meta.get(key), kind)}

    def close(self) -> None:
        self.base.close()
