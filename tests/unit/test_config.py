import pytest

from titanctl.config.job_config import JobConfig
from titanctl.config.loader import load_config, parse_overrides, reference_table, to_toml
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
        (["--optimizer.name", "adamw"], "is not one of AdamW, Adam; did you mean 'AdamW'?"),
        (["--training.steps", "0"], "'training.steps' = 0 must be >= 1"),
        (["--optimizer.lr", "-1"], "'optimizer.lr' = -1.0 must be >= 0"),
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


@pytest.mark.parametrize("recipe", ["llama3_debug", "llama3_8b", "llama3_70b", "llama3_405b"])
def test_shipped_recipes_load(repo, recipe):
    cfg = load_config(repo / "recipes" / f"{recipe}.toml")
    assert cfg.model.flavor in ("debugmodel", "8B", "70B", "405B")


def test_model_n_kv_heads_overrides_the_flavors():
    from titanctl.models.llama import model_args_from_config

    def kv_heads(*overrides):
        return model_args_from_config(load_config(None, list(overrides)).model, 300, 32).kv_heads

    assert kv_heads() == 4  # titanctl's debugmodel
    assert kv_heads("--model.n_kv_heads", "16") == 16  # torchtitan's debugmodel: multi-head attention
    assert kv_heads("--model.flavor", "8B", "--model.n_kv_heads", "4") == 4
    with pytest.raises(ConfigError, match="'model.n_kv_heads' = 3 must divide flavor debugmodel's n_heads 16"):
        kv_heads("--model.n_kv_heads", "3")
