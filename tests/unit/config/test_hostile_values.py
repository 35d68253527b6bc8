"""Hostile config values, round 4 (issue 57, classes 3 and 4): regular expressions that backtrack for
ever (``[[optimizer.groups]] params``, ``lora.target_regex``), and numbers that passed validation and then
overflowed, hung or were blamed on something else (``--optimizer.lr 1e308``, ``--lora.alpha 1e308``,
``--optimizer.muon_ns_steps 1e9``, ``--lora.rank 65536`` on a dim-256 model). Each is a one-line
ConfigError before the work. In-process: config loading and model conversion on the meta device."""

from __future__ import annotations

import time

import pytest
import torch

from tests.unit.config.test_config import FLOAT_KEYS
from titanctl.config.job_config import LoRA as LoRAConfig
from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.config.job_config import OptimizerGroup
from titanctl.config.recipe import FLOAT32_MAX, field_specs, load_config
from titanctl.config.user_regex import MAX_MATCH_SECONDS, MAX_PATTERN_CHARS, UserRegex
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.converters.lora import apply_lora, resolve_targets
from titanctl.train.param_groups import build_param_groups

NESTED = "repeats a part that holds a repeat of its own"
HOSTILE_PATTERNS = {  # pattern -> why it is refused
    "(.*.*)*!": NESTED,  # the issue's
    "(a+)+b": NESTED,
    "(layers\\.\\d+\\.)*x": NESTED,
    "(?:\\w+\\.?)+!": NESTED,
    "(wq|wqk)*z": "repeats a choice between alternatives",
    "(w)\\1": "refers back to a group",
    "(w)?(?(1)q|k)": "refers back to a group",
    ".*.*.*.*.*!": "has 5 repeats of varying length (at most 4)",
    "x" * (MAX_PATTERN_CHARS + 1): f"has 1,001 characters; a pattern has at most {MAX_PATTERN_CHARS:,}",
    "layers[": "is no regular expression: unterminated character set",
}
GOOD_PATTERNS = ["layers\\.\\d+\\.attention\\.w[qkv]\\.weight", "layers\\.\\d+\\.moe\\.experts\\.w[13]", ".*\\.weight",
                 "(layers\\.0\\.)?attention\\.wq", "layers\\.(0|1)\\.attention\\.wq", "(ab){2}\\.x*"]


def tiny_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                                     max_seq_len=64))


@pytest.mark.parametrize("pattern", sorted(HOSTILE_PATTERNS))
@pytest.mark.parametrize("where", ["lora_flag", "groups_flag", "groups_recipe"])
def test_a_backtracking_regex_is_refused_before_it_matches(tmp_path, pattern, where):
    """``(.*.*)*!`` in [[optimizer.groups]] params (recipe or command line) or lora.target_regex backtracked
    for ever; each shape that backtracks exponentially is refused when the config is read."""
    start = time.monotonic()
    quoted = pattern.replace("\\", "\\\\")
    if where == "lora_flag":
        key, run = "lora.target_regex", lambda: load_config(None, ["--lora.target_regex", pattern])
    elif where == "groups_flag":
        key, run = "optimizer.groups[0].params", lambda: load_config(
            None, ["--optimizer.groups", f'[{{params = "{quoted}"}}]'])
    else:
        recipe = tmp_path / "r.toml"
        recipe.write_text(f'[[optimizer.groups]]\nparams = "{quoted}"\n')
        key, run = "optimizer.groups[0].params", lambda: load_config(recipe)
    with pytest.raises(ConfigError) as e:
        run()
    message = str(e.value)
    assert message.startswith(f"config key '{key}' = ") and HOSTILE_PATTERNS[pattern] in message, message
    assert "\n" not in message and time.monotonic() - start < 5


def test_the_same_patterns_are_refused_where_the_model_is_matched():
    """build_param_groups and the LoRA converter check the pattern themselves (a config made in code,
    not loaded, reaches them unchecked); good patterns still match."""
    model = tiny_model()
    for pattern in ("(.*.*)*!", "(w)\\1"):
        with pytest.raises(ConfigError, match=HOSTILE_PATTERNS[pattern]):
            build_param_groups([model], OptimizerConfig(groups=[OptimizerGroup(params=pattern, optimizer="AdamW")]))
        with pytest.raises(ConfigError, match=HOSTILE_PATTERNS[pattern]):
            resolve_targets(model, LoRAConfig(target_regex=pattern))
    for pattern in GOOD_PATTERNS:
        load_config(None, ["--lora.target_regex", pattern])
    assert sorted(resolve_targets(model, LoRAConfig(target_regex="layers\\.\\d+\\.attention\\.w[qv]"))) == [
        "layers.0.attention.wq", "layers.0.attention.wv", "layers.1.attention.wq", "layers.1.attention.wv"]


def test_matching_is_bounded_in_time_for_what_the_shape_check_lets_through():
    """Four repeats are allowed, and O(n^4) on long names is still too slow: the time limit ends it."""
    names = [f"layers.{i}." + "a" * 400 for i in range(200)]
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        UserRegex("lora.target_regex", ".*.*.*.*!").matching(names)
    assert str(e.value) == (f"config key 'lora.target_regex' = '.*.*.*.*!' took more than {MAX_MATCH_SECONDS:g} s to "
                            "match 200 names: it backtracks; write it without repeats that can match the same text")
    assert time.monotonic() - start < MAX_MATCH_SECONDS + 5


# ----------------------------------------------------------------------------- class 4: numbers


@pytest.mark.parametrize("flag, value, says", [
    ("optimizer.lr", "1e308", "past float32's largest value, 3.403e+38, which training computes in; valid: > 0 and "
                              "at most 3.403e+38"),
    ("lora.alpha", "1e308", "must be in (0, 10000]"),
    ("optimizer.muon_ns_steps", "1000000000", "must be in [1, 100]"),
    ("optimizer.weight_decay", "1e300", "must be in [0, 1]"),
    ("optimizer.eps", "1e300", "must be in [0, 1]"),
    ("model.mtp_loss_weight", "1e300", "must be in [0, 10]"),
    ("moe.router_aux_loss_coef", "1e300", "must be in [0, 10]"),
    ("moe.load_balance_coeff", "2", "must be in [0, 1]"),
    ("fault_tolerance.outer_lr", "1e300", "must be in (0, 10]"),
    ("fault_tolerance.connect_timeout_seconds", "1e300", "must be in (0, 604800]"),
    ("comm.init_timeout_seconds", "4000000000000000000", "must be in [1, 604800]"),
    ("comm.trace_buf_size", "4000000000000000000", "must be in [0, 1000000]"),
    ("training.seq_len", "1000000000000", "must be in [1, 2^20]"),
    ("training.stream_shards", "1000000000000", "must be in [0, 2^16]"),
    ("training.local_batch_size", "1000000000000", "must be in [1, 2^20]"),
    ("lr_scheduler.warmup_steps", "4000000000000000000", "must be in [0, 1000000000]"),
    ("metrics.peak_tflops", "1e300", "must be in [0, 100000]"),
    ("training.max_norm", "1e39", "past float32's largest value"),
])
def test_a_number_past_what_training_can_use_is_refused_when_read(flag, value, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{flag}", value])
    assert str(e.value).startswith(f"config key '{flag}' = ") and says in str(e.value), str(e.value)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_no_float_key_takes_a_value_float32_cannot_hold(key):
    """The class: every float key is bounded by its own maximum or by float32's range."""
    meta = field_specs()[key][1].metadata
    if key == "lr_scheduler.decay_ratio" or meta["max"] is not None or meta["below"] is not None:
        with pytest.raises(ConfigError, match="must be"):
            load_config(None, [f"--{key}", "1e39"])
    else:
        with pytest.raises(ConfigError, match="past float32's largest value"):
            load_config(None, [f"--{key}", "1e39"])
    assert FLOAT32_MAX == torch.finfo(torch.float32).max


def test_a_lora_rank_past_the_layers_it_adapts_is_refused_before_any_adapter_is_made():
    """--lora.rank 65536 on a dim-256 model made 352M trainable parameters (5.7 GiB) of no use."""
    model = tiny_model()
    with pytest.raises(ConfigError) as e:
        apply_lora(model, LoRAConfig(rank=65, target_modules=["attention"]))
    assert str(e.value) == ("config key 'lora.rank' = 65 exceeds min(in, out) = 32 of target layers.0.attention.wk "
                            "(in 64, out 32): a higher rank adds parameters, not expressiveness; valid: 1 to 32 for "
                            "these targets")
    assert not any("lora" in name for name, _ in model.named_parameters())
    with pytest.raises(ConfigError, match="= 33 exceeds min\\(in, out\\) = 32 of target layers.0.attention.wk"):
        apply_lora(tiny_model(), LoRAConfig(rank=33))
    assert apply_lora(tiny_model(), LoRAConfig(rank=32, target_modules=["attention.wq"])).rank == 32
