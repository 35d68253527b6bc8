import typing

import pytest

from titanctl.config.job_config import JobConfig
from titanctl.config.recipe import field_specs, load_config, parse_overrides, reference_table, to_toml
from titanctl.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_defaults_without_recipe():
    assert load_config() == JobConfig()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    recipe = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg = load_config(recipe, ["--training.steps", "9", "--optimizer.lr=0.25"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.optimizer.lr == 0.25
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_override_forms():
    pairs = parse_overrides(["--a.b", "1", "--c.d=x,y", "--e.enable_f", "--g-h.i-j", "2"])
    assert pairs == [("a.b", "1"), ("c.d", "x,y"), ("e.enable_f", "true"), ("g_h.i_j", "2")]


def test_lists_bools_and_optionals_from_text():
    cfg = load_config(
        None,
        [
            "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_split_points", "layers.1,layers.3",
            "--checkpoint.enable_checkpoint",
            "--metrics.enable_tensorboard", "false",
            "--lr_scheduler.decay_ratio", "0.2",
            "--job.log_ranks", "0,1",
        ],
    )
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.1", "layers.3"]
    assert cfg.checkpoint.enable_checkpoint is True
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.lr_scheduler.decay_ratio == 0.2
    assert cfg.job.log_ranks == [0, 1]


def test_print_config_round_trips(tmp_path):
    cfg = load_config(None, ["--training.steps", "11", "--lr_scheduler.decay_ratio", "0.1"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--training.stepz", "3"], "unknown config key 'training.stepz' on the command line; did you mean 'training.steps'?"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'?"),
        (["--training.steps", "many"], "config key 'training.steps' expects int, got 'many'"),
        (["--training.steps", "2.5"], "expects int"),
        (["--training.deterministic", "maybe"], "expects bool"),
        (["--optimizer.name", "adamw"], "is not one of AdamW, Adam, Muon; did you mean 'AdamW'?"),
        (["--training.steps", "0"], "'training.steps' = 0 must be in [1, 1000000000]"),
        (["--optimizer.lr", "-1"], "'optimizer.lr' = -1.0 must be > 0"),
        (["--parallelism.data_parallel_shard_degree", "0"], "must be -1 or >= 1"),
        (["--training.global_batch_size", "2", "--training.local_batch_size", "4"], "global_batch_size"),
        (["--lr_scheduler.decay_ratio", "1.5"], "must be in [0, 1]"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nstepz = 3\n", "unknown config key 'training.stepz' in"),
        ("[trainin]\nsteps = 3\n", "unknown config key 'trainin.steps'"),
        ("[training]\nsteps = \"3\"\n", "expects int, got '3'"),
        ("[training]\nsteps = 3.5\n", "expects int"),
        ("[metrics]\nenable_tensorboard = 1\n", "expects bool"),
        ("[training\nsteps = 3\n", "is not valid TOML"),
        ("steps = 3\n", "unknown config key 'steps'"),
    ],
)
def test_bad_toml_names_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(write(tmp_path, text))
    assert message in str(err.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_every_field_is_documented():
    table = reference_table()
    assert "| `training.steps` | `10000` |" in table
    for line in table.splitlines()[2:]:
        assert line.rstrip("| ").split("|")[-1].strip(), line


@pytest.mark.parametrize("recipe", ["llama3_debug", "llama3_8b", "llama3_70b", "llama3_405b", "qwen3_debug_sft",
                                    "qwen3_8b_sft"])
def test_shipped_recipes_load(repo, recipe):
    cfg = load_config(repo / "recipes" / f"{recipe}.toml")
    assert cfg.model.flavor in ("debugmodel", "8B", "70B", "405B")


FLOAT_KEYS = [key for key, (typ, _) in field_specs().items() if float in (typ, *getattr(typ, "__args__", ()))]
FOLDER_KEYS = [key for key, (_, f) in field_specs().items() if f.metadata["in_dump_folder"]]


def test_float_and_folder_keys_are_found():
    assert {"optimizer.lr", "optimizer.eps", "training.max_norm", "lr_scheduler.decay_ratio"} <= set(FLOAT_KEYS)
    assert set(FOLDER_KEYS) == {"checkpoint.folder", "metrics.save_tb_folder", "profiling.save_traces_folder",
                                "profiling.save_memory_snapshot_folder"}


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}' = {value} must be a finite number"):
        load_config(None, [f"--{key}", value])


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_must_be_finite_in_toml_too(tmp_path, key):
    section, name = key.split(".")
    value = "[nan]" if typing.get_origin(field_specs()[key][0]) is list else "nan"  # a list's items too
    with pytest.raises(ConfigError, match=f"config key '{key}' = nan must be a finite number"):
        load_config(write(tmp_path, f"[{section}]\n{name} = {value}\n"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--optimizer.lr", "0"], "'optimizer.lr' = 0.0 must be > 0"),
        (["--optimizer.beta1", "1"], "'optimizer.beta1' = 1.0 must be in [0, 1)"),
        (["--optimizer.beta2", "-0.1"], "'optimizer.beta2' = -0.1 must be in [0, 1)"),
        (["--lr_scheduler.lr_min", "1.01"], "'lr_scheduler.lr_min' = 1.01 must be in [0, 1]"),
        (["--training.seed", str(2**64)], f"'training.seed' = {2**64} must be in [0, 2^64)"),
        (["--checkpoint.keep_latest_k", str(2**63)], "does not fit in 64 bits; valid: [-2^63, 2^63)"),
        (["--job.dump_folder", ""], "'job.dump_folder' is empty"),
        (["--job.dump_folder", "  "], "'job.dump_folder' is empty"),
    ],
)
def test_ranges(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_range_edges_are_accepted():
    cfg = load_config(None, ["--training.seed", str(2**64 - 1), "--optimizer.beta2", "0", "--lr_scheduler.lr_min",
                             "1", "--optimizer.lr", "1e-12"])
    assert cfg.training.seed == 2**64 - 1


def test_folder_keys_are_the_ones_documented_relative_to_the_dump_folder():
    documented = [key for key, (_, f) in field_specs().items() if "relative to job.dump_folder" in f.metadata["help"]]
    assert documented == FOLDER_KEYS


@pytest.mark.parametrize("key", FOLDER_KEYS)
@pytest.mark.parametrize(
    "value, problem",
    [("/etc", "is absolute"), ("../x", "leads out of the dump folder"), ("a/../../x", "leads out of the dump folder"),
     ("", "is the dump folder itself"), (".", "is the dump folder itself"), ("a/..", "is the dump folder itself")],
)
def test_folder_keys_stay_inside_the_dump_folder(key, value, problem):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--{key}={value}"])
    assert f"config key '{key}' = {value!r} {problem}: it must be a relative path to a folder inside" in str(err.value)


@pytest.mark.parametrize("key", FOLDER_KEYS)
def test_folder_keys_accept_sub_folders(key):
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [f"--{key}", "runs/a/../b"]), section), name) == "runs/a/../b"


def test_non_utf8_recipe_names_the_byte(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_bytes("[job]\ndescription = \"café\"\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"recipe.toml is not UTF-8 text \(byte 0xe9 at offset 24\)"):
        load_config(path)


def test_reference_table_states_the_ranges():
    table = reference_table()
    assert "| `optimizer.beta1` | `0.9` | Adam beta1. Valid: in [0, 1). |" in table
    assert "Valid: > 0." in table and "Valid: in [0, 2^64)." in table


def test_model_n_kv_heads_overrides_the_flavors():
    from titanctl.models.registry import model_args_from_config

    def kv_heads(*overrides):
        return model_args_from_config(load_config(None, list(overrides)).model, 300, 32).kv_heads

    assert kv_heads() == 2  # titanctl's debugmodel
    assert kv_heads("--model.n_kv_heads", "8") == 8  # multi-head attention
    assert kv_heads("--model.flavor", "debugmodel_torchtitan") == 16  # torchtitan's debugmodel: multi-head attention
    assert kv_heads("--model.flavor", "8B", "--model.n_kv_heads", "4") == 4
    with pytest.raises(ConfigError, match="'model.n_kv_heads' = 3 must divide flavor debugmodel's n_heads 8"):
        kv_heads("--model.n_kv_heads", "3")
