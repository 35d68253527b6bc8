"""The layouts worth considering for a recipe on N devices, each checked by the trainer's own rules.

A ``Candidate`` is everything `titanctl train` needs to run a layout: the degrees (dp_replicate,
dp_shard, tp, pp, cp, ep), the batch split (local batch, gradient accumulation, pipeline schedule and
microbatches), activation checkpointing, compile, Float8 and async TP. ``overrides`` spells it as
``--section.key VALUE`` for the train command line; ``job_config`` applies those overrides to the
recipe through the same loader and validation as train.

The enumeration keeps the recipe's model, sequence length and global batch, and follows the usual
placement rules: TP within a node (its traffic is the heaviest), CP only where the sequence splits
into 2 x cp load-balanced chunks (each CP degree as ring, as Ulysses and as the ulysses_ring hybrid for each
Ulysses degree u that stays inside a node: tp x u dividing the GPUs per node, the ring over cp / u groups),
PP only where every stage keeps a layer, EP only for MoE families.
Whether the trainer accepts a layout is asked of the trainer's functions (``ParallelDims.from_config``,
``build.check_layout``, the pipeline's stage and microbatch checks, the loader's batch rule), never
re-decided here: a family's refusals (e.g. no CP for latent attention) come from there.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from titanctl.config.job_config import JobConfig
from titanctl.errors import TitanError

AC_MODES = ("none", "selective_op", "selective_2", "full")  # how the plan names activation checkpointing
# parallelism.context_parallel_method; Ulysses where the heads split, the hybrid where u splits them (check_layout)
CP_METHODS = ("ring", "ulysses", "ulysses_ring")


@dataclass(frozen=True)
class Candidate:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    local_batch_size: int  # sequences per data-parallel rank per loader microbatch
    grad_accum: int  # loader microbatches per optimizer step
    pp_schedule: str = ""  # "" without pipelining
    pp_microbatch_size: int = 1
    ac: str = "selective_op"
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    cp_method: str = "ring"  # parallelism.context_parallel_method when cp > 1: ring, ulysses or ulysses_ring
    cp_ulysses: int = 1  # ulysses_ring: parallelism.context_parallel_ulysses_degree (the ring over cp / it)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per loader microbatch (1 without pipelining)."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp

    def describe(self) -> str:
        parts = [f"{name} {value}" for name, value in
                 (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp),
                  ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if value > 1]
        if self.cp > 1 and self.cp_method != "ring":
            parts[[p.startswith("cp ") for p in parts].index(True)] += f" {self.cp_method}" + (
                f" (ulysses {self.cp_ulysses})" if self.cp_method == "ulysses_ring" else "")
        text = " x ".join(parts) or "single device"
        if self.pp > 1:
            text += f" ({self.pp_schedule}, {self.microbatches} mb)"
        return text

    def features(self) -> str:
        out = [f"ac {self.ac}"]
        out += [name for name, on in (("compile", self.compile), ("float8", self.float8),
                                      ("async-tp", self.async_tp)) if on]
        return ", ".join(out)

    def settings(self, global_batch: int) -> dict[str, object]:
        """The config keys (section.key -> value) that select this layout."""
        mode, option = {"none": ("none", "2"), "selective_op": ("selective", "op"),
                        "selective_2": ("selective", "2"), "full": ("full", "2")}[self.ac]
        out = {
            "parallelism.data_parallel_replicate_degree": self.dp_replicate,
            "parallelism.data_parallel_shard_degree": self.dp_shard,
            "parallelism.tensor_parallel_degree": self.tp,
            "parallelism.pipeline_parallel_degree": self.pp,
            "parallelism.context_parallel_degree": self.cp,
            "parallelism.expert_parallel_degree": self.ep,
            "parallelism.enable_async_tensor_parallel": self.async_tp,
            "training.local_batch_size": self.local_batch_size,
            "training.global_batch_size": global_batch,
            "activation_checkpoint.mode": mode,
            "compile.enable": self.compile,
            "float8.enable_float8_linear": self.float8,
            # Float8's FSDP settings go with it where FSDP exists (the recipes' published choice).
            "float8.enable_fsdp_float8_all_gather": self.float8 and self.fsdp,
            "float8.precompute_float8_dynamic_scale_for_fsdp": self.float8 and self.fsdp,
        }
        if self.cp > 1:
            out["parallelism.context_parallel_method"] = self.cp_method
            # always: a recipe's own Ulysses degree would make the trainer refuse the other methods
            out["parallelism.context_parallel_ulysses_degree"] = self.cp_ulysses
        if mode == "selective":
            out["activation_checkpoint.selective_ac_option"] = option
        if self.pp > 1:
            out["parallelism.pipeline_parallel_schedule"] = self.pp_schedule
            out["parallelism.pipeline_parallel_microbatch_size"] = self.pp_microbatch_size
            # Stages from the schedule's default (one or two per rank), not from the recipe.
            out["parallelism.pipeline_parallel_split_points"] = []
            out["parallelism.pipeline_parallel_layers_per_stage"] = 0
        return out

    def overrides(self, global_batch: int) -> list[str]:
        """The train command line's ``--section.key VALUE`` pairs that select this layout."""
        args = []
        for key, value in self.settings(global_batch).items():
            if isinstance(value, bool):
                text = str(value).lower()
            else:
                text = ",".join(value) if isinstance(value, list) else str(value)
            args += [f"--{key}", text]
        return args

    def to_json(self) -> dict:
        return {
            "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate, "tp": self.tp, "pp": self.pp,
            "cp": self.cp, "cp_method": self.cp_method if self.cp > 1 else None,
            "cp_ulysses_degree": self.cp_ulysses if self.cp > 1 and self.cp_method == "ulysses_ring" else None,
            "ep": self.ep,
            "pp_schedule": self.pp_schedule or None,
            "microbatches": self.microbatches, "pp_microbatch_size": self.pp_microbatch_size if self.pp > 1 else None,
            "local_batch_size": self.local_batch_size, "grad_accum_steps": self.grad_accum, "ac": self.ac,
            "compile": self.compile, "float8": self.float8, "async_tp": self.async_tp,
        }


def job_config(recipe: JobConfig, candidate: Candidate, global_batch: int) -> JobConfig:
    """The recipe with the candidate's settings, validated by the loader's rules (the printed
    command line gives the same config through ``load_config``: the tests check it)."""
    from titanctl.config.recipe import validate

    # A copy of the sections the settings change (every value set is a new object, none is mutated).
    cfg = dataclasses.replace(recipe, **{name: copy.copy(getattr(recipe, name)) for name in (
        "training", "parallelism", "activation_checkpoint", "compile", "float8")})
    for key, value in candidate.settings(global_batch).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    validate(cfg)
    return cfg


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending: trial division up to sqrt(n), so a batch of 2^30 sequences
    takes 32,768 steps, not 2^30 (the enumeration asks for the same few numbers many times)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return (*small, *reversed(large))


@dataclass
class Enumeration:
    splits: list[Candidate]  # accepted degrees and batch splits (ac "none", no features: see variants)
    rejected: Counter  # reason -> count of layouts the trainer's checks refused


def check_candidate(recipe: JobConfig, candidate: Candidate, global_batch: int, model_args) -> None:
    """Raise the trainer's error if it would refuse ``candidate``; return quietly if it accepts it."""
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims
    from titanctl.parallel.layouts.pipeline_parallel import microbatch_count
    from titanctl.parallel.layouts.pipeline_stages import pipeline_layer_ranges
    from titanctl.planning.memory.estimate import grad_accum_steps

    cfg = job_config(recipe, candidate, global_batch)
    dims = ParallelDims.from_config(cfg.parallelism, candidate.world_size)
    check_layout(cfg, dims, model_args)
    grad_accum_steps(cfg, dims.dp)
    if dims.pp > 1:
        p = cfg.parallelism
        ranges = pipeline_layer_ranges(model_args.n_layers, dims.pp, p.pipeline_parallel_schedule)
        microbatch_count(cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size,
                         p.pipeline_parallel_schedule, len(ranges), dims.pp)


def enumerate_splits(
    recipe: JobConfig, model_args, world_size: int, global_batch: int, *, gpus_per_node: int,
    schedules: tuple[str, ...],
) -> Enumeration:
    """Every set of degrees and batch split of ``world_size`` devices that the trainer accepts, with
    the reasons for the rest. The degrees are checked once per combination (the trainer's checks do
    not depend on the batch split), pipelines once per schedule and microbatch size; activation
    checkpointing and the features (``variants``) change none of the checks."""
    seq_len = model_args.max_seq_len
    moe = model_args.moe
    rejected: Counter = Counter()
    out: list[Candidate] = []
    for tp in divisors(world_size):
        if tp > gpus_per_node or gpus_per_node % tp:
            rejected["tp must stay within a node"] += 1
            continue
        for cp in divisors(world_size // tp):
            if cp > 1 and seq_len % (2 * cp):
                rejected[f"seq_len {seq_len} does not split into 2 x cp chunks"] += 1
                continue
            for pp in divisors(world_size // (tp * cp)):
                if pp > model_args.n_layers:
                    rejected["more pipeline stages than layers"] += 1
                    continue
                rest = world_size // (tp * cp * pp)
                for dp_replicate in divisors(rest):
                    dp_shard = rest // dp_replicate
                    eps = [e for e in divisors(dp_shard * cp) if moe is not None and moe.num_experts % e == 0] or [1]
                    for ep in eps:
                        if global_batch % (dp_replicate * dp_shard):
                            rejected[f"global batch {global_batch} not divisible by the data-parallel degree"] += 1
                            continue
                        per_rank = global_batch // (dp_replicate * dp_shard)
                        for method, ulysses in cp_methods(cp, tp, gpus_per_node):
                            base = Candidate(dp_replicate, dp_shard, tp, pp, cp, ep, per_rank, 1, ac="none",
                                             cp_method=method, cp_ulysses=ulysses)
                            probe = base if pp == 1 else dataclasses.replace(
                                base, pp_schedule="GPipe", pp_microbatch_size=1)  # GPipe: any count of microbatches
                            try:
                                check_candidate(recipe, probe, global_batch, model_args)
                            except TitanError as e:
                                rejected[_reason(e)] += 1
                                continue
                            out.extend(_splits(recipe, base, per_rank, global_batch, model_args, schedules, rejected))
    return Enumeration(out, rejected)


def cp_methods(cp: int, tp: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(method, Ulysses degree) pairs worth trying at CP degree ``cp``: ring and Ulysses, and the hybrid for each
    Ulysses degree u (2 <= u < cp, dividing cp) whose all-to-alls stay inside a node (the Ulysses ranks are the
    innermost CP ranks, tp apart: tp x u divides the GPUs per node). Whether the heads split is the trainer's."""
    if cp == 1:
        return [("ring", 1)]
    hybrids = [("ulysses_ring", u) for u in divisors(cp)
               if 1 < u < cp and gpus_per_node % (tp * u) == 0]
    return [("ring", 1), ("ulysses", 1), *hybrids]


def _splits(recipe, base: Candidate, per_rank: int, global_batch: int, model_args, schedules, rejected
            ) -> list[Candidate]:
    """The batch splits of one accepted set of degrees: local batch x accumulation, or schedule x
    microbatch size (all of a rank's sequences as pipeline microbatches: fewer would only add bubble)."""
    if base.pp == 1:
        return [dataclasses.replace(base, local_batch_size=local, grad_accum=per_rank // local)
                for local in divisors(per_rank)]
    from titanctl.parallel.layouts.pipeline_parallel import microbatch_count
    from titanctl.parallel.layouts.pipeline_stages import pipeline_layer_ranges

    out = []
    for schedule in schedules:
        try:  # the trainer's stage split for this schedule
            stages = len(pipeline_layer_ranges(model_args.n_layers, base.pp, schedule))
        except TitanError as e:
            rejected[_reason(e)] += len(divisors(per_rank))
            continue
        for mb_size in divisors(per_rank):
            c = dataclasses.replace(base, pp_schedule=schedule, pp_microbatch_size=mb_size,
                                    local_batch_size=per_rank, grad_accum=1)
            try:  # the rest of check_candidate passed for these degrees (enumerate_splits)
                microbatch_count(per_rank, mb_size, schedule, stages, base.pp)
            except TitanError as e:
                rejected[_reason(e)] += 1
                continue
            out.append(c)
    return out


def variants(split: Candidate, *, compile_options: tuple[bool, ...], float8: bool, async_tp: bool
             ) -> Iterator[Candidate]:
    """``split`` with each combination of compile, Float8 and async TP the device allows (no compile for
    ulysses_ring: the trainer refuses it, its attention runs eagerly inside whole-graph compiled blocks)."""
    if split.cp > 1 and split.cp_method == "ulysses_ring":
        compile_options = tuple(o for o in compile_options if not o)
    for compiled in compile_options:
        for f8 in ((False, True) if float8 else (False,)):
            for atp in ((False, True) if async_tp and compiled and split.tp > 1 else (False,)):
                yield dataclasses.replace(split, compile=compiled, float8=f8, async_tp=atp)


def _reason(error: Exception) -> str:
    """A refusal's message with its numbers as N, so that equal reasons are counted together."""
    import re

    return re.sub(r"\d+", "N", str(error).split(": ")[0])[:120]
