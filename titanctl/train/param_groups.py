"""Which optimizer, and which settings, each parameter gets: optimizer.name's default rule, then the
``[[optimizer.groups]]`` tables, matched against canonical names (the names checkpoints use)."""

from __future__ import annotations

from torch import nn

from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.config.user_regex import UserRegex
from titanctl.errors import ConfigError
from titanctl.models.common.moe import RoutedExperts
from titanctl.parallel.layouts.weight_init import canonical_name

# Settings a group table may override, and the param-group key each one sets.
_OVERRIDES = {"lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum", "eps": "eps"}


def default_kind(name: str, module: nn.Module, param: nn.Parameter, muon: bool, muon_experts: bool) -> str:
    """With Muon: Muon for hidden linear weights (and routed experts with muon_experts); AdamW for
    embeddings, the output layer, norms, biases and the rest."""
    if not muon:
        return "adamw"
    if isinstance(module, nn.Linear) and param is module.weight and name.split(".", 1)[0] != "output":
        return "muon"
    if isinstance(module, RoutedExperts) and param.dim() == 3 and muon_experts:
        return "muon"
    return "adamw"


def named_trainable(model_parts: list[nn.Module]) -> list[tuple[str, nn.Module, nn.Parameter]]:
    """(canonical name, owning module, parameter) of every trainable parameter, each once."""
    out, seen = [], set()
    for part in model_parts:
        for module_name, module in part.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                out.append((canonical_name(f"{module_name}.{pname}".lstrip(".")), module, p))
    return out


def _check_settings_apply(n: int, table, by_kind: dict) -> None:
    """A table's Muon setting needs a Muon parameter among its own, its AdamW settings an AdamW one:
    a setting that nothing reads is refused rather than ignored."""
    for kind, fields in (("muon", ("momentum",)), ("adamw", ("beta1", "beta2", "eps"))):
        given = [f for f in fields if getattr(table, f) is not None]
        if given and kind not in by_kind:
            owner, other = ("Muon", "AdamW") if kind == "muon" else ("AdamW", "Muon")
            raise ConfigError(f"config key 'optimizer.groups[{n}].{given[0]}' is {owner}'s, but every parameter of "
                              f"that group uses {other}")


def build_param_groups(model_parts: list[nn.Module], cfg: OptimizerConfig) -> list[dict]:
    """torch param groups with a ``kind`` ("muon" or "adamw") and the settings the tables override;
    one-line ConfigErrors for a table that matches nothing and a parameter two tables match."""
    params = named_trainable(model_parts)
    muon = cfg.name == "Muon"
    muon_experts = muon and cfg.muon_experts
    names = [name for name, _, _ in params]
    matched = [set(UserRegex(f"optimizer.groups[{n}].params", table.params).matching(names))
               for n, table in enumerate(cfg.groups)]
    chosen: dict[int, list] = {}  # table index (-1: the default rule) -> parameters
    for name, module, p in params:
        hits = [n for n, names_of in enumerate(matched) if name in names_of]
        if len(hits) > 1:
            raise ConfigError(f"parameter {name!r} is matched by optimizer.groups[{hits[0]}] and "
                              f"optimizer.groups[{hits[1]}]; each parameter may belong to one group only")
        chosen.setdefault(hits[0] if hits else -1, []).append((name, module, p))
    for n, table in enumerate(cfg.groups):
        if n not in chosen:
            example = params[0][0] if params else ""
            raise ConfigError(f"config key 'optimizer.groups[{n}].params' = {table.params!r} matches no trainable "
                              f"parameter (canonical names look like {example!r})")
    groups = []
    for n in sorted(chosen):
        table = cfg.groups[n] if n >= 0 else None
        by_kind: dict[str, list] = {}
        for name, module, p in chosen[n]:
            chosen_kind = table.optimizer.lower() if table is not None and table.optimizer else None
            kind = chosen_kind or default_kind(name, module, p, muon, muon_experts)
            if kind == "muon" and p.dim() < 2:
                raise ConfigError(f"optimizer.groups[{n}] gives Muon to {name!r}, which is not a matrix "
                                  f"(shape {tuple(p.shape)}); Muon needs 2-D weights or 3-D expert stacks")
            by_kind.setdefault(kind, []).append(p)
        if table is not None:
            _check_settings_apply(n, table, by_kind)
        for kind, ps in by_kind.items():
            group = {"params": ps, "kind": kind}
            if table is not None:
                group.update({key: getattr(table, f) for f, key in _OVERRIDES.items() if getattr(table, f) is not None})
                if table.beta1 is not None or table.beta2 is not None:
                    group["betas"] = (cfg.beta1 if table.beta1 is None else table.beta1,
                                      cfg.beta2 if table.beta2 is None else table.beta2)
            groups.append(group)
    return groups
