"""peft's LoRA adapters onto a titanctl base: ``titanctl convert ADAPTER OUT --from peft --lora-base BASE``.

peft saves an adapter as ``adapter_config.json`` (rank ``r``, ``lora_alpha``, what it targets, the switches
of its variants) and ``adapter_model.safetensors`` (``base_model.model.{module}.lora_A.weight``, ``lora_B``).
This is the inverse of ``--to peft`` (``titanctl.checkpoint.lora.export``), and it writes what a titanctl
LoRA run saves: a DCP step folder of the adapters under canonical names (``layers.0.attention.wq.lora_a``)
and the model's saved buffers (the base's), whose ``titanctl.json`` records under ``lora`` the rank, alpha,
dropout, targets and the base with its fingerprint (``titanctl.checkpoint.lora.base``). That step merges
(``--merge-lora``), converts (``--to peft`` gives the adapter back, tensor for tensor) and starts a LoRA
run (``checkpoint.initial_load_path``).

- A linear layer's adapter: A as it is, B's rows in titanctl's order (Llama's q/k rows un-permuted).
- transformers 5's packed experts (peft ``target_parameters``): A is [E·r, in] expert-major, B [out, r·E]
  rank-major; one wrapper per parameter of a module, nested, the module's first parameter innermost (one
  more ``base_layer.`` in its names per wrapper around it). ``gate_up_proj``'s adapter gives the gate's and
  the up's, which share its A (rank r), or, when it is the block-diagonal adapter of twice the rank that
  ``--to peft`` writes, each its own block.
- One rank and one alpha / rank for every adapter: ``rank_pattern`` / ``alpha_pattern`` entries are taken
  where they say the same (and for that packing); rsLoRA's alpha / sqrt(r) becomes alpha · sqrt(r) / r.

The adapters are the tensors the file holds (peft saves the adapted modules, nothing else). What a titanctl
LoRA checkpoint cannot represent is refused in one line naming the field: another peft method or a LoRA
variant (DoRA, ...), a bias on B, trained base biases, fan_in_fan_out, whole modules to save, per-target
ranks or scales that differ, a module with no adapter slot, shapes other than the base's.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from titanctl.checkpoint.formats.base import DictSource, Source, TensorInfo, read_json
from titanctl.checkpoint.hf.names import from_hf_rows
from titanctl.checkpoint.lora.export import PACKED_EXPERTS, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, hf_experts_module
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import weight_shapes
from titanctl.safe_io import regular_file_size

SUPPORTED = ("plain LoRA (r, lora_alpha, lora_dropout, use_rslora) on linear layers and on transformers 5's packed "
             "experts (target_parameters)")
# Fields that do not change what a saved adapter computes: where it came from, how it was initialized, which
# modules it was matched on (the tensors say what is adapted), how a runtime holds it.
_NEUTRAL = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config",
    "megatron_core", "runtime_config", "qalora_group_size", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "ensure_weight_tying",
    "r", "lora_alpha", "lora_dropout", "use_rslora", "rank_pattern", "alpha_pattern", "target_parameters", "bias",
})
# Fields whose non-default value titanctl cannot represent, and what it would be.
_REFUSED = {
    "use_dora": "DoRA (a trained magnitude per output)",
    "lora_bias": "a trained bias on lora_B",
    "fan_in_fan_out": "transposed (fan_in, fan_out) weights, as GPT-2's Conv1D",
    "modules_to_save": "whole trained modules beside the adapters (merge them in peft first: merge_and_unload)",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "replicated layers",
}
_FACTOR = re.compile(r"(?P<module>.+?)(?P<wrappers>(?:\.base_layer)*)\.lora_(?P<factor>[AB])\.weight")
_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_peft(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, {name without peft's prefix: tensor}) of a peft adapter folder; one-line
    CheckpointErrors for missing, oversized, non-regular or unreadable files."""
    folder = Path(folder)
    config_path, weights = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    for path in (config_path, weights):
        if not path.is_file():
            bins = sorted(p.name for p in folder.glob("adapter_model*.bin")) if path == weights else []
            hint = f" ({bins[0]} is PyTorch .bin: save the adapter with safe_serialization=True)" if bins else ""
            raise CheckpointError(f"{folder} is no peft adapter folder: {path.name} is missing{hint}")
    config = read_json(config_path)
    regular_file_size(weights, what="safetensors file", error=CheckpointError)
    tensors = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype not in _FLOATS:
                    raise CheckpointError(f"{weights.name} holds {key!r} as {dtype}: adapters are floating point")
                tensors[key.removeprefix(PEFT_PREFIX)] = f.get_tensor(key)
    except SafetensorError as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {e}") from None
    return config, tensors


def check_config(config: dict[str, Any], where: str) -> None:
    """What titanctl cannot represent, refused in one line naming the field and what is supported."""
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r} is not read; titanctl reads {SUPPORTED}")
    for field, meaning in _REFUSED.items():
        if config.get(field):
            raise CheckpointError(f"{where}: {field} = {_shown(config[field])} ({meaning}) has no slot in a titanctl "
                                  f"LoRA checkpoint; titanctl reads {SUPPORTED}")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias = {config['bias']!r} trains the base's biases, which titanctl's LoRA "
                              "keeps frozen; supported: bias = 'none'")
    if config.get("init_lora_weights") == "mica":  # a variant: its A and B are not a plain adapter's
        raise CheckpointError(f"{where}: init_lora_weights = 'mica' (a LoRA variant) is not read; titanctl reads "
                              f"{SUPPORTED}")
    for field, value in config.items():
        if field not in _NEUTRAL and field not in _REFUSED and value not in (None, False, "", [], {}):
            raise CheckpointError(f"{where}: {field} = {_shown(value)} is a peft setting titanctl cannot represent; "
                                  f"titanctl reads {SUPPORTED}")
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not _whole(r):
        raise CheckpointError(f"{where}: r = {_shown(r)}, expected a positive integer")
    if not _number(alpha) or alpha <= 0:
        raise CheckpointError(f"{where}: lora_alpha = {_shown(alpha)}, expected a positive number")
    if not _number(dropout) or not 0 <= dropout < 1:
        raise CheckpointError(f"{where}: lora_dropout = {_shown(dropout)}, expected a number in [0, 1)")
    for field, check in (("rank_pattern", _whole), ("alpha_pattern", lambda v: _number(v) and v > 0)):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and check(v) for k, v in pattern.items()):
            raise CheckpointError(f"{where}: {field} = {_shown(pattern)}, expected {{module name or regex: value}}")
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(f"{where}: target_parameters = {_shown(targets)}, expected a list of parameter names")


def adapters_from_peft(config: dict[str, Any], tensors: dict[str, torch.Tensor], args: ModelArgs,
                       where: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """({rank, alpha, dropout, targets}, {canonical adapter name: tensor}) of a checked peft adapter on the
    model ``args`` describes (the base's)."""
    from titanctl.parallel.converters.lora import adapter_slots

    rank = int(config["r"])
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)  # the common one
    factors: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # module -> wrapper depth -> {"A", "B"}
    for key, tensor in tensors.items():
        m = _FACTOR.fullmatch(key)
        if m is None:
            raise CheckpointError(
                f"{where}: {PEFT_PREFIX}{key} is no lora_A / lora_B weight of a linear layer or of packed experts "
                "(embedding adapters, modules to save and trainable tokens have no slot in a titanctl LoRA checkpoint)"
            )
        depth = m.group("wrappers").count(".base_layer")
        factors.setdefault(m.group("module"), {}).setdefault(depth, {})[m.group("factor")] = tensor
    slots = adapter_slots(args)
    experts_modules = {hf_experts_module(name.rpartition(".")[0], args): name.rpartition(".")[0]
                       for name, kind in slots.items() if kind == "experts"}
    adapters: dict[str, torch.Tensor] = {}
    targets: dict[str, str] = {}
    for module, by_depth in sorted(factors.items()):
        for pair in by_depth.values():
            if set(pair) != {"A", "B"}:
                missing = ({"A", "B"} - set(pair)).pop()
                raise CheckpointError(f"{where}: the adapter on {module} has no lora_{missing}")
        if module in experts_modules:
            stack = experts_modules[module]
            found = _experts(module, stack, by_depth, config, args, rank, scale, where)
            for w, (a, b) in found.items():
                targets[f"{stack}.{w}"] = "experts"
                adapters[f"{stack}.{w}_lora_a"], adapters[f"{stack}.{w}_lora_b"] = a, b
            continue
        target = _linear_target(module, slots, args, where)
        if set(by_depth) != {0}:
            raise CheckpointError(f"{where}: the adapter on {module} is nested ({PEFT_PREFIX}{module}.base_layer...), "
                                  "as only parameters of packed experts are")
        a, b_hf = by_depth[0]["A"], by_depth[0]["B"]
        out_dim, in_dim = weight_shapes(args)[f"{target}.weight"]
        r = a.shape[0]
        if a.ndim != 2 or b_hf.ndim != 2 or a.shape[1] != in_dim or b_hf.shape != (out_dim, r):
            raise CheckpointError(
                f"{where}: the adapter on {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b_hf.shape)}, but the "
                f"base's weight is ({out_dim}, {in_dim}) (A: (r, {in_dim}), B: ({out_dim}, r)): it was made for "
                "another model"
            )
        _check_declared_rank(module, r, rank, config, where)
        _check_common_rank_and_scale(module, r, _scale(config, module, r), rank, scale, where)
        _, b = from_hf_rows(f"{module}.weight", b_hf, args)
        targets[target] = "linear"
        adapters[f"{target}.lora_a"], adapters[f"{target}.lora_b"] = a.contiguous(), b.contiguous()
    if not targets:
        raise CheckpointError(f"{where}: {PEFT_WEIGHTS} holds no adapter")
    order = list(slots)
    targets = dict(sorted(targets.items(), key=lambda item: order.index(item[0])))
    alpha = float(config["lora_alpha"]) * (math.sqrt(rank) if config.get("use_rslora") else 1.0)
    record = {"rank": rank, "alpha": alpha, "dropout": float(config.get("lora_dropout") or 0.0),
              "targets": targets}
    return record, adapters


def _linear_target(module: str, slots: dict[str, str], args: ModelArgs, where: str) -> str:
    """The titanctl linear layer peft's ``module`` is, or a one-line CheckpointError."""
    from titanctl.checkpoint.hf.names import canonical_name, structured_pieces

    if structured_pieces(f"{module}.weight", args):
        raise CheckpointError(
            f"{where}: the adapter on {module} adapts one expert's linear layer (transformers 4.x holds experts one "
            "module each); titanctl reads expert adapters as peft target_parameters on transformers 5's packed "
            "mlp.experts.gate_up_proj / down_proj"
        )
    name = canonical_name(f"{module}.weight", args)
    target = None if name is None else name.removesuffix(".weight")
    if target == "output" and args.tie_embeddings:
        raise CheckpointError(f"{where}: the adapter on {module} adapts the output layer of a model whose output layer "
                              "is its embedding (tied), which titanctl's LoRA does not (an adapter would untie them)")
    if target is None or slots.get(target) != "linear":
        raise CheckpointError(
            f"{where}: the adapter on {module} has no slot in titanctl's {args.family} model: titanctl adapts its "
            "linear layers (attention, feed-forward, experts, router, output) and transformers 5's packed experts"
        )
    return target


def _experts(module: str, stack: str, by_depth: dict[int, dict[str, torch.Tensor]], config: dict[str, Any],
             args: ModelArgs, rank: int, scale: float, where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{titanctl weight of ``stack`` (w1, w3, w2): (A [E, r, in], B [E, out, r])} of the packed parameters peft
    adapts on the experts ``module``: ``_packed_experts`` (lora.export) inverted."""
    targeted = [param for param in dict.fromkeys(p for p, _ in PACKED_EXPERTS.values())
                if _targets_parameter(f"{module}.{param}", config.get("target_parameters") or [])]
    if sorted(by_depth) != list(range(len(targeted))):
        raise CheckpointError(
            f"{where}: the adapters on {module} ({len(by_depth)} nested) are not those its target_parameters name "
            f"({', '.join(targeted) or 'none'})"
        )
    shapes = weight_shapes(args)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, param in enumerate(targeted):
        slots = sorted(((slot, w) for w, (p, slot) in PACKED_EXPERTS.items() if p == param))
        experts, rows, in_dim = shapes[f"{stack}.{slots[0][1]}"]
        out_dim = rows * len(slots)
        pair = by_depth[len(targeted) - 1 - index]  # the module's first parameter innermost: the deepest
        a, b = pair["A"], pair["B"]
        r = a.shape[0] // experts if a.ndim == 2 else 0
        if a.ndim != 2 or b.ndim != 2 or a.shape != (experts * r, in_dim) or b.shape != (out_dim, r * experts) or not r:
            raise CheckpointError(
                f"{where}: the adapter on {module}.{param} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"but the base's {param} is ({experts}, {out_dim}, {in_dim}) (A: ({experts} x r, {in_dim}), B: "
                f"({out_dim}, r x {experts})): it was made for another model"
            )
        a = a.reshape(experts, r, in_dim)
        b = b.reshape(out_dim, r, experts).permute(2, 0, 1)  # (E, out, r)
        key = f"{module}.{param}"
        _check_declared_rank(key, r, rank, config, where)
        param_scale = _scale(config, key, r)
        if len(slots) > 1 and r == rank * len(slots) and _block_diagonal(b, rows, rank) and \
                math.isclose(param_scale, scale, rel_tol=1e-12):
            for slot, w in slots:  # titanctl's own export: each slot's A rows and B block
                out[w] = (a[:, slot * rank:(slot + 1) * rank].contiguous(),
                          b[:, slot * rows:(slot + 1) * rows, slot * rank:(slot + 1) * rank].contiguous())
            continue
        _check_common_rank_and_scale(key, r, param_scale, rank, scale, where)
        for slot, w in slots:  # one A for every slot, each its rows of B
            out[w] = (a.contiguous(), b[:, slot * rows:(slot + 1) * rows].contiguous())
    return out


def _targets_parameter(key: str, target_parameters: list[str]) -> bool:
    """Whether peft's target_parameters adapt the parameter ``key`` (its own matching: the name, or a suffix
    of whole dotted parts)."""
    return any(key == t or key.endswith(f".{t}") for t in target_parameters)


def _block_diagonal(b: torch.Tensor, rows: int, rank: int) -> bool:
    """Whether B (E, slots x rows, slots x rank) is zero off its (rows, rank) diagonal blocks."""
    mask = torch.ones_like(b, dtype=torch.bool)
    for slot in range(b.shape[1] // rows):
        mask[:, slot * rows:(slot + 1) * rows, slot * rank:(slot + 1) * rank] = False
    return not b[mask].count_nonzero()


def _pattern_value(pattern: dict[str, Any], key: str, default: Any) -> Any:
    """peft's ``get_pattern_key``: the first pattern that matches the end of ``key`` at a dot, its value."""
    for candidate, value in pattern.items():
        if re.match(rf"(.*\.)?({candidate})$", key):
            return value
    return default


def _scale(config: dict[str, Any], key: str, r: int) -> float:
    """What peft multiplies the adapter on ``key`` (of rank ``r``) by: alpha / r, or rsLoRA's alpha / sqrt(r)."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _check_declared_rank(key: str, r: int, rank: int, config: dict[str, Any], where: str) -> None:
    declared = _pattern_value(config.get("rank_pattern") or {}, key, rank)
    if declared != r:
        raise CheckpointError(f"{where}: {key}'s adapter has rank {r}, but adapter_config.json gives it {declared} "
                              f"(r, rank_pattern): {PEFT_WEIGHTS} and {PEFT_CONFIG} do not belong together")


def _check_common_rank_and_scale(key: str, r: int, scale: float, rank: int, common: float, where: str) -> None:
    if r != rank or not math.isclose(scale, common, rel_tol=1e-12):
        raise CheckpointError(
            f"{where}: {key}'s adapter has rank {r} and scale {scale:g}, the adapter's r = {rank} and scale {common:g} "
            "(rank_pattern / alpha_pattern with differing values): a titanctl LoRA checkpoint has one rank and one "
            "alpha / rank for every adapter"
        )


def import_peft(adapter: Path, tmp: Path, base: Source, base_format: str, *, dtype: torch.dtype | None,
                progress) -> tuple[int, int, list[str]]:
    """Write the titanctl LoRA step of the peft ``adapter`` on ``base`` (a bound source of it) into ``tmp``
    (made already); ``progress``: a ``convert.ProgressSink``. Returns (tensors written, their bytes, notes)."""
    from titanctl.checkpoint.formats import dcp
    from titanctl.checkpoint.lora.base import LORA_KEY, base_record
    from titanctl.config.job_config import LoRA as LoRAConfig
    from titanctl.parallel.converters.lora import is_adapter, saved_shapes

    config, tensors = read_peft(adapter)
    check_config(config, str(adapter / PEFT_CONFIG))
    args = base.args
    record, adapters = adapters_from_peft(config, tensors, args, str(adapter))
    try:  # what a LoRA run of these targets saves: the adapters, and the model's buffers (the base's)
        saved = saved_shapes(args, LoRAConfig(enable=True, rank=record["rank"], alpha=record["alpha"],
                                              target_modules=list(record["targets"])))
    except ConfigError as e:  # e.g. expert adapters of a rank titanctl's grouped matmuls cannot run
        raise CheckpointError(f"{adapter}: {e}") from None
    buffers = {name: base.load(name) for name in saved if not is_adapter(name)}
    if dtype is not None:
        adapters = {name: t.to(dtype) for name, t in adapters.items()}
    state = {**adapters, **buffers}
    source = DictSource(state, args)  # no whole model: its tensors listed as they are, not bound
    source.args = args
    source.infos = [TensorInfo(name, tuple(t.shape), t.dtype, name, "the adapter") for name, t in state.items()]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    progress.start(nbytes, "peft → dcp")
    carried = {k: v for k, v in base.extra_metadata().items() if k != "step"}  # config.json, hf_files
    extra = {"contents": ["model"], "converted_from": "peft",
             LORA_KEY: {**record, "base": base_record(base.folder, base_format)}, **carried}
    dcp.write(tmp, args, source, dtype=None, progress=progress.advance, step=0, extra=extra)
    stacks = sum(kind == "experts" for kind in record["targets"].values())
    what = f"{len(record['targets']) - stacks} linear layers" + (f" and {stacks} expert stacks" if stacks else "")
    notes = [f"peft adapter of rank {record['rank']}, alpha {record['alpha']:g} on {what}, onto the base {base.folder}"]
    if config.get("use_rslora"):
        notes.append(f"rsLoRA's scale lora_alpha / sqrt(r) is kept as alpha {record['alpha']:g} (alpha / rank)")
    notes.append(f"to train on: --lora.enable --lora.rank {record['rank']} --lora.alpha {record['alpha']:g} "
                 f"--lora.target_modules {','.join(target_modules(record['targets'], args.n_layers))} "
                 "--checkpoint.initial_load_path OUT")
    return len(state), nbytes, notes


def target_modules(targets: dict[str, str], n_layers: int) -> list[str]:
    """``lora.target_modules`` that chooses ``targets``: their names within a layer when each of the
    ``n_layers`` layers has the same, else the names themselves."""
    by_layer: dict[str, set[str]] = {}
    top = []
    for name in targets:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            top.append(name)
        else:
            by_layer.setdefault(m.group(1), set()).add(m.group(2))
    shapes = {frozenset(v) for v in by_layer.values()}
    if len(shapes) > 1 or 0 < len(by_layer) < n_layers:
        return list(targets)
    return [*sorted(next(iter(shapes), ())), *top]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


__all__ = ["SUPPORTED", "adapters_from_peft", "check_config", "import_peft", "read_peft", "target_modules"]
