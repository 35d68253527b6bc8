"""Which config keys each subcommand reads, as data in one place.

A ``--section.key VALUE`` override on the command line that the running subcommand does not read is
refused by the loader (``load_config(..., command=...)``: a ``ConfigError``, one line, exit code 2)
instead of being silently ignored: ``infer-tp``'s tensor-parallel degree is its world size, so
``--parallelism.tensor_parallel_degree`` means nothing there. Keys in the recipe file are never
refused: one recipe serves train and the tools.

Patterns: ``*`` (every key), ``section.*`` or ``section.key``. For a key, the most specific pattern
that matches it in ``READS`` (read) or ``NOT_READ`` (refused, with the reason shown) decides; a key
that no pattern matches is refused without a reason. tests/unit/config/test_command_keys.py records the
keys each command's run reads and checks the table against them in both directions.
"""

from __future__ import annotations

# What a command's code path reads. train reads every key; the tools read what they build or run.
_ESTIMATE = (
    "model.*",  # the model it builds (on fake tensors) and the tokenizer's vocabulary
    "optimizer.*",  # the real optimizer and LR schedule run the step
    "lr_scheduler.*",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len", "training.max_norm",
    "training.steps", "training.mixed_precision_param", "training.mixed_precision_reduce",
    "training.cpu_linear",
    "parallelism.*",  # the layout, through the trainer's build_model_parts
    "activation_checkpoint.*",
    "compile.*",  # only to say in a note that blocks are estimated in eager mode
    "float8.enable_float8_linear",  # picks the target device; says in a note how float8 is modelled
    "lora.*",  # the adapters it builds, and the frozen base without gradients or optimizer state
)

READS: dict[str, tuple[str, ...]] = {
    "train": ("*",),
    # The same model build, layout, optimizer, schedule and checkpoints as train; prompts instead of a dataset.
    "rl": ("*", "sft.chat_template_path", "fault_tolerance.enable", "float8.enable_float8_linear"),
    "profile": (
        "*",
        # Checkpointing is off, but a run still starts from initial weights.
        "checkpoint.initial_load_path", "checkpoint.initial_load_model_weights_only",
        "checkpoint.exclude_from_loading",
        "fault_tolerance.enable",  # its run builds a Trainer, which checks it
    ),
    "estimate-memory": _ESTIMATE,
    # --validate also runs the real step on the current processes.
    "estimate-memory --validate": (*_ESTIMATE, "training.seed", "comm.init_timeout_seconds"),
    # The model of a checkpoint that does not say which (--config): its shape, and the RoPE table's length.
    "convert": (
        "model.name", "model.flavor", "model.n_layers", "model.n_kv_heads", "model.mtp_layers", "model.norm_type",
        "training.seq_len",
    ),
    "infer-tp": (
        "model.*",  # the tokenizer; the model too when the checkpoint does not say which (plain DCP)
        "training.seq_len",  # the context of such a model
        "comm.init_timeout_seconds",
        "sft.chat_template_path",  # --chat: a template other than the tokenizer's (the one a model was tuned with)
    ),
}

_ESTIMATE_NOT_READ = {
    "job.*": "it starts no run and writes nothing",
    "training.dataset": "it feeds random token ids",
    "training.dataset_path": "it feeds random token ids",
    "training.datasets": "it feeds random token ids",
    "training.stream_shards": "it feeds random token ids",
    "checkpoint.*": "checkpoints are not estimated",
    "float8.*": "float8 linears are estimated in the training dtype",
    "metrics.*": "it logs no metrics",
    "profiling.*": "it records no traces",
    "validation.*": "it estimates a training step, not an evaluation",
    "moe.*": "it takes routing as balanced, whatever balances it",
    "sft.*": "it feeds random token ids",
    "fault_tolerance.*": "it estimates one replica group's step",
}

_RL_ONLY = "only titanctl rl reads the [rl] section"

# Refused keys, with the reason the error shows.
NOT_READ: dict[str, dict[str, str]] = {
    "train": {"rl.*": _RL_ONLY},
    "rl": {
        "training.dataset": "its prompts are rl.dataset",
        "training.dataset_path": "its prompts are rl.dataset",
        "training.datasets": "its prompts are rl.dataset",
        "training.stream_shards": "its prompts are rl.dataset",
        "training.global_batch_size": "an update trains rl.prompts_per_step x rl.group_size sequences",
        "model.attn_mask_type": "each sequence is one prompt and its completion: attention is causal",
        "model.mtp_loss_weight": "its loss is the policy loss",
        "parallelism.disable_loss_parallel": "it refuses tensor parallelism",
        "parallelism.pipeline_parallel_split_points": "it refuses pipeline parallelism",
        "parallelism.pipeline_parallel_layers_per_stage": "it refuses pipeline parallelism",
        "parallelism.pipeline_parallel_schedule": "it refuses pipeline parallelism",
        "parallelism.pipeline_parallel_schedule_csv": "it refuses pipeline parallelism",
        "parallelism.pipeline_parallel_microbatch_size": "it refuses pipeline parallelism",
        "parallelism.context_parallel_rotate_method": "it refuses context parallelism",
        "parallelism.context_parallel_method": "it refuses context parallelism",
        "parallelism.context_parallel_ulysses_degree": "it refuses context parallelism",
        "parallelism.context_parallel_load_balancer": "it refuses context parallelism",
        "float8.*": "its sampler and trainer compute in training.mixed_precision_param",
        "moe.*": "it moves no expert bias and adds no auxiliary loss",
        "metrics.peak_tflops": "it reports tokens/s, not MFU",
        "validation.*": "its rollouts' rewards are its evaluation",
        "sft.*": "its prompts are not chat data to learn",
        "profiling.*": "it records no traces",
        "fault_tolerance.*": "it does not run as a torchft replica group",
    },
    "profile": {
        "rl.*": _RL_ONLY,
        "training.steps": "--steps sets it",
        "profiling.enable_profiling": "it always records a step",
        "profiling.profile_freq": "it records the last of --steps steps",
        "checkpoint.*": "checkpointing is off while profiling",
        "validation.*": "it records a training step, without validation",
        "fault_tolerance.*": "it records one process's step, not a torchft replica group's",
    },
    "estimate-memory": {
        **_ESTIMATE_NOT_READ,
        "training.seed": "only --validate reads it, for the real step",
        "comm.*": "it runs on a fake process group; --validate reads comm.init_timeout_seconds",
    },
    "estimate-memory --validate": {
        **_ESTIMATE_NOT_READ,
        "comm.*": "its two steps use comm.init_timeout_seconds only",
    },
    "convert": {
        "*": "it converts weights: only the model's shape is taken from the recipe",
        "model.*": "the recipe gives the model's shape (name, flavor, n_layers, n_kv_heads, mtp_layers, "
        "norm_type) only",
        "model.tokenizer_path": "--tokenizer-path gives the tokenizer of its output",
    },
    "infer-tp": {
        "*": "it only generates text",
        "parallelism.*": "its tensor-parallel degree is the world size",
        "training.seed": "its sampling seed is --seed",
        "compile.*": "--compile compiles its decode step",
        "checkpoint.*": "its weights come from --checkpoint",
        "model.attn_mask_type": "a prompt is one document: generation is always causal",
        "model.mtp_loss_weight": "it predicts one token at a time: the prediction depths are for training",
        "model.indexer_loss_coeff": "it generates: the indexer's loss is for training",
        "model.indexer_warmup_steps": "it generates: the indexer's warm-up is for training",
    },
}


def _specificity(pattern: str) -> int:
    return 0 if pattern == "*" else 1 if pattern.endswith(".*") else 2


def _matches(pattern: str, key: str) -> bool:
    return pattern == "*" or pattern == key or (pattern.endswith(".*") and key.startswith(pattern[:-1]))


def decide(command: str, key: str) -> tuple[bool, str]:
    """(whether ``command`` reads ``key``, the reason it does not: '' when none is given)."""
    if command not in READS:
        raise ValueError(f"unknown command {command!r}: titanctl.config.commands.READS has {', '.join(READS)}")
    best = (-1, False, "")
    for pattern in READS[command]:
        if _matches(pattern, key) and _specificity(pattern) > best[0]:
            best = (_specificity(pattern), True, "")
    for pattern, reason in NOT_READ.get(command, {}).items():
        if _matches(pattern, key) and _specificity(pattern) >= best[0]:  # a tie: refused
            best = (_specificity(pattern), False, reason)
    return best[1], best[2]


def reads(command: str, key: str) -> bool:
    return decide(command, key)[0]


def describe(command: str, keys: list[str]) -> str:
    """What ``command`` reads among ``keys`` (every key, in order), as short as it goes: a section
    read whole is ``section.*``; when most keys are read, the ones it does not read are listed."""

    def compact(chosen: set[str]) -> list[str]:
        out = []
        for section in dict.fromkeys(k.split(".", 1)[0] for k in keys):
            own = [k for k in keys if k.startswith(section + ".")]
            picked = [k for k in own if k in chosen]
            out.extend([f"{section}.*"] if picked and picked == own else picked)
        return out

    read = {k for k in keys if reads(command, k)}
    if read == set(keys):
        return "it reads every key"
    said = "it reads: " + ", ".join(compact(read)) if read else "it reads no key"
    unread = "it reads every key except: " + ", ".join(compact(set(keys) - read))
    return min(said, unread, key=len)


def refusal(command: str, key: str, keys: list[str]) -> str | None:
    """The error for ``--key`` on ``command``'s command line; None when the command reads it."""
    read, reason = decide(command, key)
    if read:
        return None
    because = f" ({reason})" if reason else ""
    return f"--{key} is not read by {command}{because}; {describe(command, keys)}"
