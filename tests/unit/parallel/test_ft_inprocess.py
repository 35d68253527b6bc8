"""torchft pieces that need no process: healing state round trips, model fragments, the syncs a step
has seen, which replica group a Flight Recorder dump names, a restarted semi-synchronous group with no
peer left, and who heals from whom when a group comes back from an older checkpoint."""

import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from titanctl import _torch_compat
from titanctl.config.recipe import load_config
from titanctl.errors import TitanError
from titanctl.observability.fr_analysis import analyze, parse_dump
from titanctl.parallel.runtime import ft_state, hang_watchdog
from titanctl.parallel.runtime.fault_tolerance import (
    POSITIONS_FILE,
    Positions,
    ReplicaGroup,
    Trainable,
    import_torchft,
    model_fragments,
    sync_position,
)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(11, 4)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(3)})
        self.norm = torch.nn.LayerNorm(4)
        self.output = torch.nn.Linear(4, 11)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def trained(seed: int, steps: int):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        model(torch.randint(0, 11, (2, 5))).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_heal_copies_a_peer_bitwise_also_into_a_fresh_optimizer():
    peer, peer_opt, _ = trained(0, 3)
    sent = pickle.loads(pickle.dumps({"model": ft_state.model_state([peer]),
                                      "optimizer": ft_state.optimizer_state(peer_opt)}))  # as the transport does
    fresh, fresh_opt, _ = trained(1, 0)  # a restarted group: other weights, no optimizer state yet
    ft_state.load_model_state([fresh], sent["model"])
    ft_state.load_optimizer_state(fresh_opt, sent["optimizer"])
    for a, b in zip(peer.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    # The next step, same data: still bitwise equal (the optimizer state came along).
    x = torch.randint(0, 11, (2, 5))
    for m, o in ((peer, peer_opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
    for a, b in zip(peer.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_fragments_cover_every_parameter_once_in_layer_order():
    model = Tiny()
    fragments = model_fragments(model, 2)
    names = [[n for n, _ in f.named_parameters()] for f in fragments]
    assert names[0][:2] == ["tok_embeddings.weight", "layers_0.weight"] and names[1][-1] == "output.bias"
    ids = [id(p) for f in fragments for p in f.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())


def test_positions_resume_where_the_groups_stream_stood(tmp_path):
    path = tmp_path / "ft_positions_rank0.json"
    p = Positions(path, keep=2)
    for step in range(1, 7):
        p.record(step, {"samples_consumed": 8 * step}, keep_for_checkpoint=step % 2 == 0, syncs=step // 3)
    again = Positions(path, keep=2)
    assert again.latest_step() == 6
    assert again.at(4) == {"samples_consumed": 32}  # a checkpoint step: a whole-job restart from it
    assert again.at(9) == {"samples_consumed": 48}  # down since step 6: its own stream goes on
    assert sorted(again.saved) == [4, 6]  # keep_latest_k
    assert [again.syncs_at(s) for s in (2, 4, 5, 6)] == [None, 1, None, 2]  # the Manager's, at checkpoints


def test_positions_keep_the_last_sync(tmp_path):
    path = tmp_path / "ft_positions_rank0.json"
    p = Positions(path, keep=0)
    assert p.synced_loader(0) is None  # before its first sync a group's stream resumes at its beginning
    for step in range(1, 4):
        p.record(step, {"samples_consumed": 8 * step}, keep_for_checkpoint=False, synced=step == 2)
    assert Positions(path, keep=0).synced_loader(3) == {"samples_consumed": 16}


def test_positions_keep_the_last_sync_at_each_checkpoint(tmp_path):
    """A whole-job restart from checkpoint step 3: a group that heals then goes back to its last sync
    before step 3, not to the one its record reached later."""
    path = tmp_path / "ft_positions_rank0.json"
    p = Positions(path, keep=2)
    for step in range(1, 10):
        p.record(step, {"samples_consumed": 8 * step}, keep_for_checkpoint=step % 3 == 0, synced=step % 2 == 0)
    again = Positions(path, keep=2)
    assert again.synced_loader(9) == {"samples_consumed": 64}
    assert again.synced_loader(6) == {"samples_consumed": 48}  # synced at the checkpoint step itself
    with pytest.raises(TitanError, match="no record of this group's last sync before step 3"):
        again.synced_loader(3)  # keep_latest_k = 2 dropped it with checkpoint step 3
    p = Positions(tmp_path / "first.json", keep=0)
    p.record(1, {"samples_consumed": 8}, keep_for_checkpoint=True)
    p.record(2, {"samples_consumed": 16}, keep_for_checkpoint=False, synced=True)
    assert p.synced_loader(1) is None  # no sync before checkpoint step 1: its stream's beginning


@pytest.mark.parametrize("min_replicas, why", [
    (1, "no live replica group is left to heal from"),  # the Lighthouse forms a quorum of this group alone
    (2, "no live replica group came to a sync within 1.0 s"),  # no quorum forms: torchft's TimeoutError
])
def test_a_restarted_group_with_no_live_peer_stops_in_one_line(tmp_path, monkeypatch, min_replicas, why):
    """Group 1 trained 3 steps with local_sgd, was killed, and comes back when no other group is live: the
    sync it joins has no one to heal from. It must not train alone from its initial weights."""
    from torchft.coordination import LighthouseServer

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # torchrun's
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address())
    Positions(tmp_path / POSITIONS_FILE.format(rank=0), keep=0).record(3, {"samples_consumed": 24}, False)
    cfg = load_config(None, [
        "--fault_tolerance.enable", "--fault_tolerance.semi_sync_method", "local_sgd",
        "--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2",
        "--fault_tolerance.connect_timeout_seconds", "0.2", "--fault_tolerance.process_group_timeout_seconds", "0.4",
        "--fault_tolerance.timeout_seconds", "0.8", "--fault_tolerance.quorum_timeout_seconds", "1",
    ])
    group = ReplicaGroup(cfg, 0, 1, tmp_path, torch.device("cpu"))
    try:
        model, opt, sched = trained(0, 0)
        group.attach(Trainable([model], opt, sched, loader=None, get_step=lambda: 0, set_step=lambda s: None))
        assert group.rejoining
        with group.semi_sync(model) as algorithm, pytest.raises(TitanError) as e:
            group.rejoin(algorithm)
        assert why in str(e.value) and "\n" not in str(e.value)
        assert "restart the whole job from the newest checkpoint" in str(e.value)
    finally:
        group.close()
        lighthouse.shutdown()


SEMI_SYNC = {  # both sync every 2 steps: LocalSGD all weights, DiLoCo one of 2 fragments
    "local_sgd": ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "2"],
    "diloco": ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4",
               "--fault_tolerance.fragments", "2"],
}


class CountingManager:
    """What LocalSGD and DiLoCo ask of torchft's Manager, for one group alone: its step moves as the real
    one's does, once per committed quorum."""

    _use_async_quorum = False

    def __init__(self):
        self.step = 0

    def current_step(self):
        return self.step

    def start_quorum(self):
        pass

    def should_commit(self):
        self.step += 1
        return True

    def allreduce(self, tensor, should_quantize=False):
        from torchft.work import _DummyWork
        return _DummyWork(tensor)  # one group: its average is its own

    def register_state_dict_fn(self, key, load_fn, save_fn):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass


@pytest.mark.parametrize("method", ["none", *SEMI_SYNC])
def test_sync_position_counts_syncs_as_torchft_does(method):
    """Steps through torchft's own LocalSGD / DiLoCo: after every step, the Manager's step and the
    algorithm's steps since its last sync are what sync_position says."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    ft = load_config(None, SEMI_SYNC.get(method, [])).fault_tolerance
    if method == "none":  # a quorum and a commit every step
        assert [sync_position(s, ft) for s in (0, 1, 7)] == [(0, 0), (1, 0), (7, 0)]
        return
    model, opt, _ = trained(0, 0)
    manager = CountingManager()
    algorithm = (LocalSGD(manager, model, opt, sync_every=ft.sync_steps) if method == "local_sgd" else
                 DiLoCo(manager, model_fragments(model, ft.fragments), opt,
                        [torch.optim.SGD(f.parameters(), lr=0.5) for f in model_fragments(model, ft.fragments)],
                        sync_every=ft.sync_steps))
    with algorithm:
        for step in range(1, 8):
            model(torch.randint(0, 11, (2, 5))).sum().backward()
            opt.step()
            opt.zero_grad()
            assert sync_position(step, ft) == (manager.step, algorithm._local_step), step


class RegisteringManager(CountingManager):
    """Keeps what DiLoCo's fragments register, where torchft's Manager keeps it (titanctl reads it there)."""

    def __init__(self):
        super().__init__()
        self._user_state_dicts, self._load_state_dict_fns = {}, {}

    def register_state_dict_fn(self, key, load_fn, save_fn):
        self._load_state_dict_fns[key], self._user_state_dicts[key] = load_fn, save_fn


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, by intent
@pytest.mark.parametrize("attach", [True, False])
def test_diloco_state_through_a_checkpoint_between_syncs_continues_bitwise(tmp_path, attach):
    """A DiLoCo group (2 fragments, one synced every 2 steps, Nesterov momentum) checkpointed at step 3,
    between syncs, with a fragment that has outer momentum and one that has none yet: loaded through DCP
    into a fresh DiLoCo (the load before the object exists), it trains steps 4-7 as the uninterrupted one.
    ``attach`` False: the loaded state never reaches DiLoCo (global weights = the loaded local weights, no
    momentum), which a restart did before: it must differ."""
    import torch.distributed.checkpoint as dcp
    from torchft.local_sgd import DiLoCo

    from titanctl.checkpoint.run.state import ModelState, OptimizerState
    from titanctl.parallel.runtime.diloco_state import DiLoCoState

    ft = load_config(None, [*SEMI_SYNC["diloco"], "--fault_tolerance.outer_momentum", "0.9"]).fault_tolerance
    batches = [torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(s)) for s in range(8)]

    def group(model, opt, from_step: int, state: DiLoCoState, attach_state: bool = True):
        """DiLoCo as semi_sync builds it for a group at ``from_step`` (the Manager's syncs and the
        steps since the last one as a resumed group sets them)."""
        manager = RegisteringManager()
        syncs, since = sync_position(from_step, ft)
        manager.step = syncs
        fragments = model_fragments(model, ft.fragments)
        outer = [torch.optim.SGD(f.parameters(), lr=0.5, momentum=0.9, nesterov=True) for f in fragments]
        algorithm = DiLoCo(manager, fragments, opt, outer, sync_every=ft.sync_steps)
        _torch_compat.set_inner_steps_since_sync(algorithm, since)
        state.manager = manager
        if attach_state:
            state.attach(fragments)
        return algorithm

    def train(model, opt, algorithm, steps):
        with algorithm:
            for s in steps:
                model(batches[s]).sum().backward()
                opt.step()
                opt.zero_grad()

    def checkpoint(model, opt, state):
        return {"model": ModelState([model]), "optimizer": OptimizerState(ModelState([model]), opt), "diloco": state}

    model, opt, _ = trained(0, 0)
    state = DiLoCoState(model, None, momentum=True)
    algorithm = group(model, opt, 0, state)
    train(model, opt, algorithm, range(3))
    dcp.save(checkpoint(model, opt, state), checkpoint_id=tmp_path, no_dist=True)
    train(model, opt, algorithm, range(3, 7))

    again, again_opt, _ = trained(1, 0)  # other weights: everything comes from the checkpoint
    again_state = DiLoCoState(again, None, momentum=True)
    dcp.load(checkpoint(again, again_opt, again_state), checkpoint_id=tmp_path, no_dist=True)
    again_algorithm = group(again, again_opt, 3, again_state, attach_state=attach)
    train(again, again_opt, again_algorithm, range(3, 7))
    same = [torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters())]
    assert all(same) if attach else not all(same)


def test_a_diloco_run_refuses_a_checkpoint_without_diloco_state_in_one_line(trained_run, tmp_path):
    """A checkpoint saved without DiLoCo would leave the global weights at whatever the model loaded: the
    run says so, unless checkpoint.exclude_from_loading names diloco."""
    import shutil

    from tests.conftest import TRUSTED_RUN
    from titanctl.checkpoint.run.load_plan import plan_load
    from titanctl.checkpoint.run.manager import CheckpointManager
    from titanctl.errors import CheckpointError
    from titanctl.parallel.runtime.diloco_state import DiLoCoState
    from titanctl.train.trainer import Trainer

    for exclude in ([], ["--checkpoint.exclude_from_loading", "diloco"]):
        out = tmp_path / f"run{len(exclude)}"
        t = Trainer(load_config(None, [*TRUSTED_RUN, "--job.dump_folder", str(out), *exclude]))
        try:
            shutil.copytree(trained_run / "checkpoint", out / "checkpoint")  # saved by a run without DiLoCo
            state = DiLoCoState(t.model_parts[0], None, momentum=True)
            manager = CheckpointManager(
                t.cfg, model_parts=t.model_parts, optimizer=t.optimizer, lr_scheduler=t.lr_scheduler,
                loader=t.loader, model_args=t.model_args, rank=0, world_size=1, dp_degree=1,
                device=torch.device("cpu"), log=lambda _: None, extra_states={"diloco": state},
            )
            if not exclude:
                with pytest.raises(CheckpointError, match="holds no DiLoCo state.*exclude_from_loading = diloco"):
                    manager.load(plan_load(t.cfg, t.model_args))
            else:
                assert manager.load(plan_load(t.cfg, t.model_args)).step == 2 and state.pending is None
        finally:
            t.close()


def _replica_group(tmp_path, monkeypatch, replica_id: int, method: str) -> tuple[ReplicaGroup, object]:
    """Rank 0 of a one-process replica group, with the TCPStore torchrun would give it."""
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    cfg = load_config(None, [
        "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica_id),
        "--fault_tolerance.group_size", "2", *SEMI_SYNC[method],
        # Generous: nothing here waits for a timeout, and on loaded cores (the suite's torchrun worlds beside it)
        # a 4 s process-group timeout once ran out while the TCPStore accepted the peer.
        "--fault_tolerance.connect_timeout_seconds", "5", "--fault_tolerance.process_group_timeout_seconds", "15",
        "--fault_tolerance.timeout_seconds", "30", "--fault_tolerance.quorum_timeout_seconds", "60",
    ])
    folder = tmp_path / f"replica_{replica_id}"
    folder.mkdir(exist_ok=True)
    return ReplicaGroup(cfg, 0, 1, folder, torch.device("cpu")), store


@pytest.mark.parametrize("method, loaded_step, live_step, failed_syncs", [
    ("local_sgd", 5, 9, 0),  # group 0 alone from its checkpoint of step 5 (2 syncs); group 1 live at 4 syncs
    ("diloco", 5, 9, 0),
    ("local_sgd", 5, 5, 0),  # the whole job again from that checkpoint: the same count of syncs
    # A sync failed before group 0's checkpoint of step 7: its Manager (and group 1's) counted 2, not 3;
    # group 1 has not synced since. Counted from the step, group 0 would be ahead and heal group 1.
    ("local_sgd", 7, 7, 1),
])
def test_a_group_back_from_an_older_checkpoint_heals_from_the_live_group(
        tmp_path, monkeypatch, method, loaded_step, live_step, failed_syncs):
    """Group 0 (which writes the checkpoints) was killed and started again alone: it loaded its checkpoint
    of step 5 while group 1 trained on to step 9. Each trains one step, which ends in a sync (every 2
    steps): group 0, behind, heals there from group 1, never group 1 from group 0's older state. The whole
    job started again from that checkpoint, or group 1 not synced since it: neither heals, the sync
    averages them."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address())
    groups, steps, models = [], [loaded_step, live_step], []
    if failed_syncs:  # what group 0's Manager counted at its checkpoint step, as its positions recorded it
        (tmp_path / "replica_0").mkdir()
        Positions(tmp_path / "replica_0" / POSITIONS_FILE.format(rank=0), keep=0).record(
            loaded_step, {}, keep_for_checkpoint=True, syncs=loaded_step // 2 - failed_syncs)
    try:
        for g in range(2):
            group, store = _replica_group(tmp_path, monkeypatch, g, method)
            groups.append((group, store))
            model, opt, sched = trained(g, 1)  # weights of their own
            models.append(model)
            group.attach(Trainable([model], opt, sched, loader=None, get_step=lambda g=g: steps[g],
                                   set_step=lambda s, g=g: steps.__setitem__(g, s)))
            if g == 1 and (live_step > loaded_step or failed_syncs):  # live all along: its Manager counted
                group.manager.load_state_dict({"step": live_step // 2 - failed_syncs, "batches_committed": 0})
        x = torch.randint(0, 11, (2, 5))

        def one_step(g: int) -> dict[str, torch.Tensor]:
            group, model = groups[g][0], models[g]
            with group.semi_sync(model):
                model(x).sum().backward()
                opt = group.trainable.optimizer
                opt.step()  # its post hook syncs when due
                opt.zero_grad()
            return {k: v.clone() for k, v in model.state_dict().items()}

        with ThreadPoolExecutor(2) as pool:  # each sync waits in the quorum for the other group
            after = list(pool.map(one_step, range(2)))
        rows = [group.metrics() for group, _ in groups]  # what each group's next metrics row adds
        healed = ["heal_seconds" in row for row in rows]
        if loaded_step < live_step:
            assert healed == [True, False]
            assert rows[0]["missed_steps"] == live_step - loaded_step  # its rows 6..9 never come
            assert steps == [live_step, live_step]  # group 0 took group 1's step; group 1's did not go back
            assert all(torch.equal(after[0][k], after[1][k]) for k in after[1])
            if method == "local_sgd":  # group 1's weights are its own step's: the sync averaged it with itself
                alone, alone_opt, _ = trained(1, 1)
                alone(x).sum().backward()
                alone_opt.step()
                assert all(torch.equal(v, after[1][k]) for k, v in alone.state_dict().items())
        else:
            assert healed == [False, False]
            assert steps == [loaded_step, loaded_step]
            assert all(torch.equal(after[0][k], after[1][k]) for k in after[1])  # both took the average
        assert [group.manager.current_step() for group, _ in groups] == [live_step // 2 - failed_syncs + 1] * 2
    finally:
        for group, _ in groups:
            group.close()
        lighthouse.shutdown()


def _dump(rank: int, ops: list[str]) -> dict:
    return {
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "entries": [{"collective_seq_id": i + 1, "profiling_name": f"gloo:{op}", "process_group": ["0", "default_pg"],
                     "input_sizes": [[4]], "input_dtypes": ["Float"], "state": "scheduled"} for i, op in enumerate(ops)],
        "titanctl": {"rank": rank, "replica_group": 1},
    }


def test_inspect_trace_names_the_replica_group_that_stalled(tmp_path):
    dumps = [parse_dump(_dump(0, ["all_reduce", "all_reduce"]), tmp_path / "rank0.json"),
             parse_dump(_dump(1, ["all_reduce"]), tmp_path / "rank1.json")]
    report = analyze(dumps)
    assert report.replica_groups == [1]
    assert report.summary[0].startswith("replica group 1: "), report.summary


def test_watchdog_messages_name_the_group():
    hang_watchdog.set_replica_group(2)
    try:
        assert hang_watchdog.who(3) == "replica group 2 rank 3"
    finally:
        hang_watchdog.set_replica_group(None)
    assert hang_watchdog.who(3) == "rank 3"



# ----------------------------------------------------------------------------- hostile Lighthouse addresses (issue 57)

BAD_LIGHTHOUSES = {  # address -> what the one line says
    "not a url": "has scheme 'none', not http or https",
    "file:///etc/passwd": "has scheme 'file', not http or https",
    "http://localhost:99999": "is no URL (Port out of range 0-65535)",
    "http://localhost:port": "is no URL (Port could not be cast to integer value as 'port')",
    "http://localhost": "names no a port",
    "http://:29510": "names no a host",
    "http://[::1:29510": "is no URL (Invalid IPv6 URL)",
    "http://[fe80::zz]:29510": "does not appear to be an IPv4 or IPv6 address",
    "http://\x1b[31mred\x1b[0m:29510": "'http://\\x1b[31mred\\x1b[0m:29510' holds control characters",
    "http://no-such-host.invalid:29510": "names a host that does not resolve",
    "http://127.0.0.1:1": "refuses connections (Connection refused)",
}


@pytest.fixture(scope="module")
def torchrun_store():
    """torchrun's store, one for the module: a master TCPStore waits seconds for its server thread when it is
    freed, which a time bound would count."""
    return torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def lighthouse_group(monkeypatch, tmp_path, torchrun_store):
    return lambda address, **kwargs: _lighthouse_group(monkeypatch, tmp_path, torchrun_store, address, **kwargs)


def _lighthouse_group(monkeypatch, tmp_path, store, address: str, env: bool = False,
                      timeouts: tuple[str, ...] = ("1", "2", "3", "60")) -> ReplicaGroup:
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address if env else "")
    where = [] if env else ["--fault_tolerance.lighthouse_address", address]
    keys = ("connect_timeout_seconds", "process_group_timeout_seconds", "timeout_seconds", "quorum_timeout_seconds")
    cfg = load_config(None, ["--fault_tolerance.enable", *where,
                             *(x for key, value in zip(keys, timeouts) for x in (f"--fault_tolerance.{key}", value))])
    return ReplicaGroup(cfg, 0, 1, tmp_path, torch.device("cpu"))


@pytest.mark.parametrize("address", sorted(BAD_LIGHTHOUSES))
@pytest.mark.parametrize("env", [False, True])
def test_a_bad_lighthouse_address_is_one_line_before_the_manager_starts(lighthouse_group, address, env):
    """Each was an 83-line traceback from torchft's Manager; the escape bytes were printed raw."""
    import gc
    import time

    import_torchft()  # its first import takes seconds on a busy machine: not the check's time
    gc.collect()  # nor an earlier test's Manager, whose shutdown waits when it is collected
    start = time.monotonic()
    with pytest.raises(TitanError) as e:
        lighthouse_group(address, env=env)
    message = str(e.value)
    assert BAD_LIGHTHOUSES[address] in message and "\n" not in message and "\x1b" not in message, message
    assert ("TORCHFT_LIGHTHOUSE" if env else "fault_tolerance.lighthouse_address") in message
    assert time.monotonic() - start < 3  # within connect_timeout_seconds (1 s) and then some


def test_an_address_that_does_not_answer_is_refused_within_the_connect_timeout(lighthouse_group, monkeypatch):
    """An unreachable Lighthouse took 77 s and 1,319 lines; now fault_tolerance.connect_timeout_seconds."""
    import socket
    import time

    from titanctl.parallel.runtime import lighthouse

    def silent(*args, **kwargs):  # a host that never answers: the lookup waits past the limit
        time.sleep(5)
        raise socket.gaierror("no answer")

    monkeypatch.setattr(lighthouse.socket, "getaddrinfo", silent)
    import_torchft()
    start = time.monotonic()
    with pytest.raises(TitanError) as e:
        lighthouse_group("http://10.255.255.1:29510")
    assert str(e.value) == ("the torchft Lighthouse 'http://10.255.255.1:29510' (fault_tolerance.lighthouse_address) "
                            "does not answer within 1 s (fault_tolerance.connect_timeout_seconds); start it first "
                            "(scripts/ft_local.py), or fix the address")
    assert time.monotonic() - start < 3
    assert socket.getaddrinfo is silent


def test_an_address_that_answers_but_is_no_lighthouse_is_one_line_at_the_first_quorum(lighthouse_group):
    """A port that accepts connections and says nothing: the Manager starts, its first quorum times out."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    group = lighthouse_group(f"http://127.0.0.1:{listener.getsockname()[1]}", timeouts=("0.2", "0.4", "0.8", "1"))
    try:
        model, opt, sched = trained(0, 0)
        group.attach(Trainable([model], opt, sched, loader=None, get_step=lambda: 0, set_step=lambda s: None))
        with pytest.raises(TitanError) as e:
            group.begin_step()
        assert "formed no quorum within fault_tolerance.quorum_timeout_seconds = 1 s for this group's first step" in \
            str(e.value) and "is it a Lighthouse" in str(e.value) and "\n" not in str(e.value)
    finally:
        group.close()
        listener.close()
