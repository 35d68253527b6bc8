"""[fault_tolerance]: its keys load from a recipe, and the relations between them are one-line errors."""

import pytest

from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError

ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def test_recipe_section_loads(tmp_path):
    recipe = tmp_path / "ft.toml"
    recipe.write_text(
        "[fault_tolerance]\nenable = true\nreplica_id = 1\ngroup_size = 3\nmin_replica_size = 2\n"
        'semi_sync_method = "diloco"\nsync_steps = 4\nfragments = 2\nouter_lr = 0.5\nouter_nesterov = false\n'
    )
    ft = load_config(recipe).fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size, ft.min_replica_size) == (True, 1, 3, 2)
    assert (ft.semi_sync_method, ft.sync_steps, ft.fragments, ft.outer_lr, ft.outer_nesterov) == (
        "diloco", 4, 2, 0.5, False)


@pytest.mark.parametrize("args, error", [
    # Each inverted neighbour pair of the timeout table is named, inner first.
    (["--fault_tolerance.connect_timeout_seconds", "25"],
     "timeouts inverted: 'fault_tolerance.connect_timeout_seconds' = 25 must be below "
     "'fault_tolerance.process_group_timeout_seconds' = 20"),
    (["--fault_tolerance.process_group_timeout_seconds", "30"],
     "'fault_tolerance.process_group_timeout_seconds' = 30 must be below 'fault_tolerance.timeout_seconds' = 30"),
    (["--fault_tolerance.timeout_seconds", "90"],
     "'fault_tolerance.timeout_seconds' = 90 must be below 'fault_tolerance.quorum_timeout_seconds' = 60"),
    (["--comm.train_timeout_seconds", "50"],
     "'fault_tolerance.quorum_timeout_seconds' = 60 must be below 'comm.train_timeout_seconds' = 50"),
    (["--fault_tolerance.replica_id", "2"], "'fault_tolerance.replica_id' = 2 must be below fault_tolerance.group_size = 2"),
    (["--fault_tolerance.min_replica_size", "3"], "'fault_tolerance.min_replica_size' = 3 exceeds"),
    (["--fault_tolerance.fragments", "2"], "needs fault_tolerance.semi_sync_method = diloco (now none)"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "3",
      "--fault_tolerance.fragments", "2"], "'fault_tolerance.sync_steps' = 3 must be a multiple of"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "must be 1 with fault_tolerance.enable"),
    (["--fault_tolerance.semi_sync_method", "sgd"], "is not one of none, local_sgd, diloco"),
    (["--fault_tolerance.process_group", "mpi"], "is not one of gloo, nccl"),
])
def test_invalid_is_one_line(args, error):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*ON, *args])
    assert error in str(raised.value) and "\n" not in str(raised.value)


def test_checked_only_when_enabled():
    # A recipe that keeps a [fault_tolerance] section for later still trains without it.
    assert not load_config(None, ["--fault_tolerance.connect_timeout_seconds", "99"]).fault_tolerance.enable


def test_defaults_are_ordered():
    assert load_config(None, ON).fault_tolerance.enable
