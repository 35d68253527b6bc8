"""Each subcommand refuses a command-line override it does not read (``titanctl.config.commands``),
and that table tells the truth both ways, as recorded from real runs of the commands in process:
a run reads no key its command refuses, and every key a command declares is read by some run.

How a read is recorded: while a run goes, every section dataclass of the JobConfig counts the
reads of its fields, except those the loader makes (loading and validating every key is not a
read by the command), those ``to_toml`` makes (a checkpoint's copy of the config) and reads of a
value the command itself set first (profile sets training.steps from --steps: the recipe's value
is never read). The static walk of test_config_keys_are_read.py cannot do this: it sees that some
module reads a key, not which command's run reaches that module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import sys
import typing
from pathlib import Path

import pytest

from titanctl.config import commands
from titanctl.config import recipe as loader
from titanctl.config.commands import NOT_READ, READS, describe, reads
from titanctl.config.job_config import JobConfig
from titanctl.config.recipe import field_specs, load_config
from titanctl.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "recipes" / "llama3_debug.toml")


def keys() -> list[str]:
    return list(field_specs())


def sections() -> dict[str, type]:
    return typing.get_type_hints(JobConfig)


# ------------------------------------------------------------------------------------ the table


def test_every_pattern_names_a_section_or_a_key():
    valid = {"*"} | {f"{s}.*" for s in sections()} | set(keys())
    for command in READS:
        patterns = [*READS[command], *NOT_READ.get(command, {})]
        assert [p for p in patterns if p not in valid] == [], command
    assert set(NOT_READ) <= set(READS)


def test_no_pattern_is_both_read_and_refused():
    for command, refused in NOT_READ.items():
        assert set(READS[command]) & set(refused) == set(), command


def test_every_command_that_takes_overrides_has_an_entry():
    from titanctl.cli.app import OVERRIDES, app

    with_overrides = {c.name for c in app.registered_commands if c.context_settings == OVERRIDES}
    assert with_overrides == {"train", "rl", "estimate-memory", "profile", "infer-tp", "convert", "convert-checkpoint"}
    assert with_overrides - {"convert-checkpoint"} <= set(READS)  # convert's long name: the same entry


def test_train_reads_every_key_but_the_rl_section():
    assert [k for k in keys() if not reads("train", k)] == [k for k in keys() if k.startswith("rl.")]
    assert describe("train", keys()) == "it reads every key except: rl.*"


def test_the_most_specific_pattern_decides():
    assert reads("profile", "checkpoint.initial_load_path") and not reads("profile", "checkpoint.interval")
    assert reads("profile", "optimizer.lr") and not reads("profile", "training.steps")
    assert not reads("estimate-memory", "comm.init_timeout_seconds")
    assert reads("estimate-memory --validate", "comm.init_timeout_seconds")
    assert not reads("estimate-memory --validate", "comm.trace_buf_size")
    assert reads("estimate-memory", "float8.enable_float8_linear") and not reads("estimate-memory", "float8.filter_fqns")
    assert not reads("estimate-memory", "training.deterministic")  # matched by no pattern: not read
    assert commands.decide("estimate-memory", "training.deterministic") == (False, "")


def test_an_unknown_command_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown command 'plan'"):
        load_config(None, ["--model.n_layers", "2"], command="plan")


# ------------------------------------------------------------------------------------ the loader


def test_infer_tp_refuses_the_tensor_parallel_degree():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallelism.tensor_parallel_degree", "2"], command="infer-tp")
    assert str(e.value) == (
        "--parallelism.tensor_parallel_degree is not read by infer-tp (its tensor-parallel degree is the world "
        "size); it reads: model.name, model.flavor, model.n_layers, model.n_kv_heads, model.norm_type, "
        "model.tokenizer_path, model.mtp_layers, training.seq_len, sft.chat_template_path, "
        "comm.init_timeout_seconds"  # not attn_mask_type
    )


def test_convert_refuses_an_unread_override_before_looking_at_the_checkpoint(tmp_path):
    from titanctl.cli.app import app

    argv = ["convert", str(tmp_path / "missing"), str(tmp_path / "out"), "--config", RECIPE, "--training.steps", "3"]
    with pytest.raises(ConfigError, match=r"^--training.steps is not read by convert \(it converts weights: only the "
                                          r"model's shape is taken from the recipe\); it reads: model.name, "):
        app(args=argv, prog_name="titanctl", standalone_mode=False)


@pytest.mark.parametrize(
    "command, override, reason",
    [
        ("infer-tp", "--optimizer.lr=1e-3", "(it only generates text)"),
        ("infer-tp", "--training.seed=3", "(its sampling seed is --seed)"),
        ("estimate-memory", "--metrics.log_freq=3", "(it logs no metrics)"),
        ("estimate-memory", "--training.seed=3", "(only --validate reads it, for the real step)"),
        ("estimate-memory", "--float8.filter_fqns=output", "(float8 linears are estimated in the training dtype)"),
        ("estimate-memory", "--training.deterministic", "; it reads: model.*, optimizer.*, lr_scheduler.*, "),
        ("profile", "--training.steps=3", "(--steps sets it)"),
        ("profile", "--checkpoint.interval=3", "(checkpointing is off while profiling)"),
        ("convert", "--training.steps=3", "(it converts weights: only the model's shape is taken from the recipe)"),
        ("convert", "--model.tokenizer_path=t", "(--tokenizer-path gives the tokenizer of its output)"),
    ],
)
def test_an_unread_override_names_the_key_the_command_and_why(command, override, reason):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], command=command)
    message = str(e.value)
    assert message.startswith(f"{key} is not read by {command}") and reason in message and "\n" not in message


@pytest.mark.parametrize(
    "command, overrides",
    [
        ("infer-tp", ["--model.n_layers", "3", "--training.seq_len", "64", "--comm.init_timeout_seconds", "9"]),
        ("estimate-memory", ["--parallelism.data_parallel_shard_degree", "2", "--float8.enable_float8_linear"]),
        ("estimate-memory --validate", ["--training.seed", "3", "--comm.init_timeout_seconds", "9"]),
        ("profile", ["--metrics.log_freq", "2", "--checkpoint.initial_load_path", "x", "--profiling.save_traces_folder", "t"]),
        ("train", ["--parallelism.tensor_parallel_degree", "2", "--training.steps", "3", "--checkpoint.interval", "2"]),
        ("convert", ["--model.name", "qwen3", "--model.n_layers", "2", "--training.seq_len", "64"]),
    ],
)
def test_a_read_override_is_applied(command, overrides):
    cfg = load_config(None, overrides, command=command)
    assert cfg == load_config(None, overrides)


def test_keys_in_the_recipe_are_not_refused(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[parallelism]\ntensor_parallel_degree = 2\n[optimizer]\nlr = 0.5\n[training]\nsteps = 7\n")
    for command in READS:
        cfg = load_config(recipe, command=command)
        assert cfg.parallelism.tensor_parallel_degree == 2 and cfg.optimizer.lr == 0.5 and cfg.training.steps == 7


def test_the_refusal_comes_before_the_recipe_and_the_value_are_read(tmp_path):
    with pytest.raises(ConfigError, match="is not read by infer-tp"):
        load_config(tmp_path / "missing.toml", ["--parallelism.tensor_parallel_degree", "two"], command="infer-tp")
    with pytest.raises(ConfigError, match="config file not found"):  # without a command, as before
        load_config(tmp_path / "missing.toml", ["--parallelism.tensor_parallel_degree", "2"])


def test_an_unknown_key_still_gets_the_nearest_valid_one():
    with pytest.raises(ConfigError, match="did you mean 'parallelism.tensor_parallel_degree'"):
        load_config(None, ["--parallelism.tensor_parallel_degre", "2"], command="infer-tp")


# ------------------------------------------------------------------------------ recorded reads


class _Recorder:
    def __init__(self):
        self.reads: set[str] = set()
        self.paused = 0


_RECORDING: list[_Recorder] = []  # the recording under way


def _paused(fn):
    """``fn``, whose reads the recording under way (if any) does not count."""
    def run(*args, **kwargs):
        if not _RECORDING:
            return fn(*args, **kwargs)
        rec = _RECORDING[-1]
        rec.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            rec.paused -= 1
    return run


_WRITTEN = "_titanctl_test_written"  # per section object (deepcopy carries it): fields the run set


@contextlib.contextmanager
def recording():
    """Record the config keys read until the block ends (see the module docstring)."""
    rec = _Recorder()
    classes = []
    for section, cls in sections().items():
        names = frozenset(f.name for f in dataclasses.fields(cls))

        def get(self, name, _section=section, _names=names):
            if name in _names and not rec.paused:
                if name not in object.__getattribute__(self, "__dict__").get(_WRITTEN, ()):
                    rec.reads.add(f"{_section}.{name}")
            return object.__getattribute__(self, name)

        def put(self, name, value, _names=names):
            own = object.__getattribute__(self, "__dict__")
            if name in _names and name in own and not rec.paused:  # not __init__: a later assignment
                own.setdefault(_WRITTEN, set()).add(name)
            object.__setattr__(self, name, value)

        cls.__getattribute__, cls.__setattr__ = get, put
        classes.append(cls)

    # load_config sets and validates every key through these; to_toml is imported by name elsewhere too
    # (a module first imported while a recording runs keeps the wrapper: it pauses whichever recording runs).
    patched = [(loader, "_set", loader._set), (loader, "validate", loader.validate)]
    patched += [(m, "to_toml", loader.to_toml) for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith("titanctl") and getattr(m, "to_toml", None) is loader.to_toml]
    for module, name, fn in patched:
        setattr(module, name, _paused(fn))
    _RECORDING.append(rec)
    try:
        yield rec
    finally:
        _RECORDING.remove(rec)
        for module, name, fn in patched:
            setattr(module, name, fn)
        for cls in classes:
            del cls.__getattribute__, cls.__setattr__


def test_the_recorder_sees_reads_and_not_the_loader_nor_values_set_first():
    cfg = load_config(None, ["--training.steps", "5"])
    with recording() as rec:
        load_config(None, ["--optimizer.lr", "0.5"])
        loader.to_toml(cfg)
        cfg.training.steps = 9
        assert cfg.training.steps == 9 and cfg.optimizer.lr == 8e-4
    assert rec.reads == {"optimizer.lr"}
    assert "__getattribute__" not in vars(type(cfg.training))


TINY = ["--config", RECIPE, "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--compile.enable", "false", "--lr_scheduler.warmup_steps", "0"]  # no warmup: the decay keys are read
ESTIMATE = ["estimate-memory", *TINY, "--model.n_layers", "2", "--training.steps", "2", "--json"]


def _scenarios(tmp: Path) -> list[tuple[str, str, list[str]]]:
    """(name, command in the table, argv). Each run sets what makes its command read more keys."""
    train = tmp / "train"
    plain = tmp / "plain"  # a DCP folder without titanctl.json: infer-tp takes the model from the recipe
    return [
        ("train", "train", ["train", *TINY, "--training.steps", "2", "--job.dump_folder", str(train),
                            "--checkpoint.interval", "1", "--checkpoint.last_save_model_weights_only",
                            "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                            "--validation.enabled", "--validation.freq", "2", "--validation.steps", "1"]),
        # LoRA adapters on the run's step-1 (float8, which the profile run takes, does not carry them).
        ("train: lora", "train", ["train", *TINY, "--training.steps", "1", "--job.dump_folder", str(tmp / "lora"),
                                  "--lora.enable", "--checkpoint.initial_load_path", str(train / "checkpoint" / "step-1")]),
        # The chat fine-tuning recipe, from scratch (the [sft] keys; the shipped chat set for training and validation).
        ("train: chat", "train", ["train", "--config", str(REPO / "recipes" / "qwen3_debug_sft.toml"), *TINY[2:],
                                  "--training.seq_len", "128", "--training.steps", "1", "--job.dump_folder",
                                  str(tmp / "chat"), "--checkpoint.initial_load_path", "", "--validation.steps", "1",
                                  "--metrics.enable_tensorboard", "false", "--optimizer.name", "Muon",
                                  "--optimizer.muon_experts"]),
        # GRPO from the train run's last step, with a reference model and the sampler-mismatch correction.
        ("rl", "rl", ["rl", "--config", str(REPO / "recipes" / "llama3_debug_grpo.toml"), *TINY[2:],
                      "--training.steps", "2", "--job.dump_folder", str(tmp / "rl"), "--checkpoint.interval", "1",
                      "--checkpoint.initial_load_path", str(train / "checkpoint" / "step-2"),
                      "--rl.prompts_per_step", "2", "--rl.group_size", "2", "--rl.max_response_tokens", "4",
                      "--rl.split", "validation", "--rl.kl_coef", "0.1", "--rl.importance_correction", "token_truncate",
                      "--rl.overlong_buffer_tokens", "2", "--rl.epsilon_high", "0.28", "--rl.rewards",
                      "exact_match,format", "--rl.format_regex", "[0-9]+", "--rl.reward_weights", "1,0.5",
                      "--rl.scale_rewards", "batch", "--rl.dynamic_sampling", "--sft.chat_template_path", "",
                      "--activation_checkpoint.mode", "selective", "--training.gc_freq", "1",
                      "--checkpoint.last_save_in_hf"]),
        ("profile", "profile", ["profile", *TINY, "--steps", "2", "--job.dump_folder", str(tmp / "profile"),
                                "--float8.enable_float8_linear", "--activation_checkpoint.mode", "selective",
                                "--checkpoint.initial_load_path", str(train / "checkpoint" / "step-1")]),
        ("infer-tp", "infer-tp", ["infer-tp", "--checkpoint", str(plain), "--prompt", "To be", "--max-new-tokens",
                                  "2", "--temperature", "0", "--chat", *TINY[:6]]),  # --chat: the template's key
        ("convert", "convert", ["convert", str(plain), str(tmp / "converted"), *TINY[:6]]),
        ("estimate: pipeline", "estimate-memory", [*ESTIMATE, "--world-size", "2",
                                                   "--parallelism.pipeline_parallel_degree", "2",
                                                   "--activation_checkpoint.mode", "selective", "--lora.enable"]),
        ("estimate: fsdp, tp, cp", "estimate-memory", [*ESTIMATE, "--world-size", "4",
                                                       "--parallelism.tensor_parallel_degree", "2",
                                                       "--parallelism.context_parallel_degree", "2",
                                                       "--optimizer.name", "Muon"]),  # Muon on sharded fakes
        ("estimate: validate", "estimate-memory --validate", [*ESTIMATE, "--world-size", "1", "--validate"]),
    ]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, tuple[str, set[str]]]:
    """Scenario name -> (its command, the keys its run read): each command run in process, as the CLI does."""
    from titanctl.cli.app import app

    tmp = tmp_path_factory.mktemp("command_keys")
    out = {}
    for name, command, argv in _scenarios(tmp):
        if name == "infer-tp":  # the trained run's last step, less its titanctl.json
            shutil.copytree(tmp / "train" / "checkpoint" / "step-2", tmp / "plain",
                            ignore=shutil.ignore_patterns("titanctl.json", "config.toml"))
        with recording() as rec:
            app(args=argv, prog_name="titanctl", standalone_mode=False)
        out[name] = (command, set(rec.reads))
    return out


# Keys a run looks at although its command refuses them: checked, then of no effect on what it does.
CHECKED_ONLY = {
    "estimate-memory": {
        "float8.enable_fsdp_float8_all_gather",  # refused without float8 linears; turned off with them
        "float8.precompute_float8_dynamic_scale_for_fsdp",
    },
    "profile": {
        "checkpoint.folder",  # the dump folder's subfolders are checked for links; nothing is saved there
        "checkpoint.async_mode",  # checked against the device; nothing is saved
        "checkpoint.load_step",  # range-checked; nothing is resumed
        "checkpoint.create_seed_checkpoint",  # the trainer would write a seed and not train: no trace to read
    },
}
CHECKED_ONLY["estimate-memory --validate"] = CHECKED_ONLY["estimate-memory"]
CHECKED_ONLY["rl"] = {
    *CHECKED_ONLY["estimate-memory"],  # refused without float8 linears, which rl refuses
    # the dump folder's subfolders are checked for links and rights (the trainer's shell); nothing is recorded
    "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.enable_memory_snapshot",
    "profiling.save_memory_snapshot_folder",
    "moe.load_balance_coeff",  # Hugging Face saves check the expert bias it would train; rl refuses the key: 0
}


def test_a_run_reads_no_key_its_command_refuses(recorded):
    for name, (command, read) in recorded.items():
        refused = sorted(k for k in read if not reads(command, k) and k not in CHECKED_ONLY.get(command, ()))
        assert refused == [], f"{name}: read, but refused by titanctl.config.commands for {command}"


def _layout(key: str) -> bool:
    """Keys that only multi-rank layouts read: the estimate-memory runs build those layouts with the
    trainer's own build_model_parts, so they witness them for train and profile too."""
    return key.startswith("parallelism.") or key == "training.mixed_precision_reduce"


def read_by_replica_groups() -> set[str]:
    """The [fault_tolerance] keys that its code reads. Only a torchrun world with a Lighthouse reads them
    (tests/distributed/test_fault_tolerance.py and test_ft_semi_sync.py run those), not a run in this
    process: a key no line of that code names (``.key``) is read by no run."""
    code = "".join((REPO / "titanctl" / path).read_text() for path in (
        "parallel/runtime/fault_tolerance.py", "config/recipe.py", "train/trainer.py"))
    return {k for k in keys() if k.startswith("fault_tolerance.") and re.search(rf"\.{k.split('.')[1]}\b", code)}


def test_every_key_a_command_declares_is_read_by_a_run(recorded):
    def by(*names):
        return set().union(*(recorded[n][1] for n in names))

    estimates = by("estimate: pipeline", "estimate: fsdp, tp, cp")
    # The LoRA run's keys: profile builds its model with the trainer too (train: lora witnesses them).
    layouts = {k for k in estimates if _layout(k)} | {k for k in by("train: lora") if k.startswith("lora.")}
    layouts |= {k for k in by("train: chat") if k.startswith("sft.")}  # profile reads data as train does
    layouts |= {k for k in by("train: chat") if k.startswith("optimizer.muon")}  # ... and builds its optimizer
    witnesses = {
        "infer-tp": by("infer-tp"),
        "convert": by("convert"),
        "estimate-memory": estimates,
        "estimate-memory --validate": estimates | by("estimate: validate"),  # --validate estimates first
        "profile": by("profile") | layouts,
        "train": by("train", "train: lora", "train: chat", "profile") | layouts | read_by_replica_groups(),  # profile runs the trainer (with float8, an initial load)
        # rl builds its model, layout, optimizer and checkpoints with the trainer's code, as profile does
        "rl": by("rl") | layouts,
    }
    assert set(witnesses) == set(READS)
    for command, seen in witnesses.items():
        unread = [k for k in keys() if reads(command, k) and k not in seen]
        assert unread == [], f"declared as read by {command} in titanctl.config.commands, but no run read them"
