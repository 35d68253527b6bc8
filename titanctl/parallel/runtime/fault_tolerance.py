"""One replica group of a torchft job: the trainer's only door to torchft.

Each replica group is a torchrun world of its own (FSDP, TP, ... inside it). torchft's Lighthouse
forms a quorum of the live groups every step; its Manager (one per rank) joins rank r of every live
group in a managed process group, through which the groups average their gradients. A group that
starts behind the quorum's step (a restarted one) receives parameters, optimizer state, LR schedule
and step from a live peer over torchft's checkpoint transport before it trains, so no group ever
restarts from a checkpoint and no step counter goes back.

Each group reads its own share of the data (data-parallel ranks replica_id x S .. + S - 1 of
group_size x S). Its loader position is its own: a group that was down missed those steps, so on
its return it goes on where its own stream stood, which ``positions`` records after every commit.

The Trainer calls, per step: ``begin_step`` (quorum; heal), ``average_gradients`` (after backward),
``commit`` (before the optimizer step; False: drop the step and train it again). With
``semi_sync_method`` local_sgd or diloco the groups instead sync every ``sync_steps`` steps through
torchft's own ``LocalSGD`` / ``DiLoCo``, hooked on the optimizer (``semi_sync``). A group restarted
between syncs has nothing worth training alone: before its first step it joins the live groups' next
sync (``rejoin``), heals there from a peer and goes back in its own stream to its last sync, since the
samples of its unsynchronized steps never reached the shared model. A group restarted from a checkpoint
(the one that writes them) resumes the Manager's count of syncs where it stood at that step, so that at
its next sync it heals from a live group that synced since, never the reverse.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanctl import _torch_compat
from titanctl.errors import ConfigError, TitanError
from titanctl.parallel.runtime import ft_state, hang_watchdog
from titanctl.parallel.runtime.diloco_state import PART as DILOCO_PART
from titanctl.parallel.runtime.diloco_state import DiLoCoState
from titanctl.parallel.runtime.lighthouse import check_lighthouse
from titanctl.safe_io import visible

POSITIONS_FILE = "ft_positions_rank{rank}.json"
REPLICA_ID_DIGITS = 4  # torchft orders groups by their id's text: replica_0002 < replica_0010


@dataclass
class Trainable:
    """What a replica group keeps in step with its peers (the Trainer's own objects)."""

    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loader: Any  # TokenWindowLoader: its state_dict/load_state_dict
    get_step: Callable[[], int]
    set_step: Callable[[int], None]


def import_torchft():
    try:
        import torchft
    except ImportError as e:
        raise ConfigError(
            f"fault_tolerance.enable needs torchft ({e}); install it with `pip install titanctl[ft]`"
        ) from None
    return torchft


class ReplicaGroup:
    def __init__(self, cfg, rank: int, world_size: int, dump_folder: Path, device):
        """Starts this rank's Manager at once: the group heartbeats to the Lighthouse while it builds
        its model, so that a quorum formed meanwhile waits for it (torchft's join timeout) instead of
        starting without it. ``attach`` hands it the state to keep in step before the first step."""
        torchft = import_torchft()
        ft = cfg.fault_tolerance
        self.cfg = cfg.fault_tolerance
        self.rank, self.world_size = rank, world_size
        self.trainable: Trainable | None = None
        self.replica_id = ft.replica_id
        hang_watchdog.set_replica_group(ft.replica_id)  # the watchdog's dumps and messages name the group
        lighthouse = ft.lighthouse_address or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ConfigError(
                "fault_tolerance.enable needs a Lighthouse: set fault_tolerance.lighthouse_address or "
                "TORCHFT_LIGHTHOUSE (scripts/ft_local.py starts one; docs/fault-tolerance.md)"
            )
        source = "fault_tolerance.lighthouse_address" if ft.lighthouse_address else "TORCHFT_LIGHTHOUSE"
        check_lighthouse(lighthouse, ft.connect_timeout_seconds, source)
        if not os.environ.get("MASTER_ADDR"):
            raise TitanError("fault_tolerance.enable: launch each replica group with torchrun (MASTER_ADDR is not set)")
        if ft.process_group == "nccl" and device.type != "cuda":
            raise ConfigError("fault_tolerance.process_group = nccl needs CUDA; use gloo on CPU")
        seconds = datetime.timedelta
        pg_class = torchft.ProcessGroupNCCL if ft.process_group == "nccl" else torchft.ProcessGroupGloo
        self.process_group = pg_class(timeout=seconds(seconds=ft.process_group_timeout_seconds))
        self.positions = Positions(dump_folder / POSITIONS_FILE.format(rank=rank), keep=cfg.checkpoint.keep_latest_k)
        self.restored_step = self.positions.latest_step()  # where this group's own rows and stream stood
        self._healed: float | None = None  # seconds the last heal took, until a metrics row reports it
        self._healed_from: int | None = None
        self.lost_steps = 0
        self.diloco_state: DiLoCoState | None = None
        self.lighthouse, self._joined = f"{visible(repr(lighthouse))} ({source})", False
        try:
            self.manager = self._manager(torchft, lighthouse)
        except RuntimeError as e:  # torchft's connection errors (the address answered TCP, not as a Lighthouse)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TitanError(f"torchft's Manager could not start with the Lighthouse {visible(repr(lighthouse))} "
                             f"({source}): {visible(first)[:300]}") from None

    def _manager(self, torchft, lighthouse: str):
        seconds = datetime.timedelta
        return torchft.Manager(
            pg=self.process_group,
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=self.cfg.min_replica_size,
            # A group that heals takes the peer's state before its forward, then trains the step with the others.
            use_async_quorum=False,
            timeout=seconds(seconds=self.cfg.timeout_seconds),
            quorum_timeout=seconds(seconds=self.cfg.quorum_timeout_seconds),
            connect_timeout=seconds(seconds=self.cfg.connect_timeout_seconds),
            rank=self.rank,
            world_size=self.world_size,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.cfg.replica_id:0{REPLICA_ID_DIGITS}d}",
            # Every group initializes the same weights from training.seed: step 0 needs no copy.
            init_sync=False,
        )

    def attach(self, trainable: Trainable) -> None:
        self.trainable = trainable
        # A semi-synchronous group that trained before (its positions say so) and now starts with no
        # checkpoint of its own was restarted: its weights are its initial ones, nothing to train alone.
        self.rejoining = self.cfg.semi_sync_method != "none" and trainable.get_step() == 0 and self.restored_step > 0
        # The Manager's step counts committed syncs (every step's, without semi_sync_method). -1 is behind
        # every live group, even before their first sync (step 0, where torchft heals nobody without
        # init_sync): the quorum of the sync this group joins has it heal from one of them. A group that
        # loaded a checkpoint takes the count its Manager had at that step (a sync that failed did not
        # count), else counts the syncs up to the step: a group restarted alone from an older checkpoint
        # is then behind the live groups and heals from them, never they from its older state.
        step = -1
        if not self.rejoining:
            step = self.positions.syncs_at(trainable.get_step())
            if step is None:  # a checkpoint this group's positions have no record of (written elsewhere)
                step = sync_position(trainable.get_step(), self.cfg)[0]
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._syncs_seen = step
        self._healed_at_sync = step
        self._missed_steps = 0

    def checkpoint_states(self, model: torch.nn.Module) -> dict[str, Any]:
        """What this group's checkpoints hold besides the Trainer's own state: with DiLoCo its fragments'
        global weights and outer optimizers (``model``: the module semi_sync gets)."""
        if self.cfg.semi_sync_method != "diloco":
            return {}
        self.diloco_state = DiLoCoState(model, self.manager, momentum=self.cfg.outer_momentum != 0)
        return {DILOCO_PART: self.diloco_state}

    # ----------------------------------------------------------------------------- healing

    def _state(self) -> dict[str, Any]:
        t = self.trainable
        return {
            "model": ft_state.model_state(t.model_parts),
            "optimizer": ft_state.optimizer_state(t.optimizer),
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "step": t.get_step(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        t = self.trainable
        ft_state.load_model_state(t.model_parts, state["model"])
        ft_state.load_optimizer_state(t.optimizer, state["optimizer"])
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._healed_from = t.get_step()
        self._healed_at_sync = self.manager.current_step()  # the quorum's step, set before this is called
        t.set_step(state["step"])
        # The data stream stays this group's own: where it stood at the step the group now resumes. Semi-
        # synchronous: at its last sync; the steps it trained since then are replaced by the peer's state,
        # so their samples are trained again.
        if self.cfg.semi_sync_method == "none":
            position = self.positions.at(state["step"])
        else:
            position = self.positions.synced_loader(state["step"])
        if position is not None:  # None: the group never trained (or synced); its stream starts at its beginning
            t.loader.load_state_dict(position)

    # ----------------------------------------------------------------------------- one step

    def begin_step(self) -> None:
        """Join this step's quorum; a group behind the quorum's step takes a live peer's state now."""
        before = self.trainable.get_step()
        start = time.perf_counter()
        self._healed_from = None
        try:
            self.manager.start_quorum()
        except (TimeoutError, RuntimeError) as e:
            if self._joined:
                raise
            # The group's first quorum: the address answered TCP, but no Lighthouse formed a quorum with it.
            why = visible(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:120]
            raise TitanError(
                f"the torchft Lighthouse {self.lighthouse} formed no quorum within "
                f"fault_tolerance.quorum_timeout_seconds = {self.cfg.quorum_timeout_seconds:g} s for this group's "
                f"first step ({why}): is it a Lighthouse, and do fault_tolerance.min_replica_size = "
                f"{self.cfg.min_replica_size} groups run?"
            ) from None
        self._joined = True
        self._note_heal(start)
        self.lost_steps = max(0, before - self.trainable.get_step())  # a counter that went back: a bug

    def _note_heal(self, start: float) -> None:
        """After a quorum that may have healed this group: what its next metrics row says about it."""
        if self._healed_from is not None:
            self._healed = time.perf_counter() - start
            # The steps this group sat out: since its own last commit (a restarted group: before it went down).
            own = max(self._healed_from, self.positions.latest_step())
            self._missed_steps = self.trainable.get_step() - own

    def average_gradients(self, params: list[torch.Tensor], loss_share: torch.Tensor | None) -> torch.Tensor | None:
        """Average this rank's gradient shards, and its share of the step's loss, with rank r of every
        live group: one managed all-reduce per dtype. Returns the averaged loss share. A failure is
        recorded by the Manager, and the step then does not commit."""
        tensors = [ft_state.local(p.grad) for p in params if p.grad is not None]
        n_grads = len(tensors)
        as_loss = loss_share  # under loss parallel a DTensor, replicated over tp: its local value travels
        if loss_share is not None:
            tensors.append(ft_state.local(loss_share).detach().reshape(1))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
            self.manager.allreduce(flat).wait()
            for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
                if i < n_grads:
                    tensors[i].copy_(piece.view_as(tensors[i]))
                else:
                    loss_share = piece.reshape(())
        if isinstance(as_loss, DTensor):
            loss_share = DTensor.from_local(loss_share, as_loss.device_mesh, as_loss.placements, run_check=False)
        return loss_share

    def commit(self) -> bool:
        """Whether every live group's step succeeded: step the optimizer only then."""
        return self.manager.should_commit()

    def committed(self, step: int, keep_for_checkpoint: bool) -> None:
        """Record where this group's stream stands after ``step`` (also kept apart at checkpoint steps,
        and as the last sync's when the step ended in one: the Manager counts committed syncs)."""
        syncs = self.manager.current_step()
        synced = syncs != self._syncs_seen
        self._syncs_seen = syncs
        self.positions.record(step, self.trainable.loader.state_dict(), keep_for_checkpoint, synced=synced,
                              syncs=syncs)

    def is_lowest_live(self) -> bool:
        """The group that writes checkpoints: the first of the quorum (ids order numerically, padded);
        before any quorum (semi-synchronous training before its first sync), group 0."""
        rank = self.manager.participating_rank()
        return rank == 0 if rank is not None else self.replica_id == 0

    def metrics(self) -> dict[str, Any]:
        live = self.manager.num_participants()
        row = {"live_replicas": live, "participating_ranks": live * self.world_size, "lost_steps": self.lost_steps}
        if self._healed is not None:  # on the row of the step this group healed before
            row["heal_seconds"] = round(self._healed, 4)
            row["missed_steps"] = self._missed_steps
            self._healed = None
        return row

    @contextlib.contextmanager
    def semi_sync(self, model: torch.nn.Module):
        """local_sgd / diloco: torchft's own LocalSGD or DiLoCo, hooked on the optimizer for the block;
        between syncs the group trains alone (no quorum, no cross-group collective)."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        optimizer = self.trainable.optimizer
        if self.cfg.semi_sync_method == "local_sgd":
            algorithm = LocalSGD(self.manager, model, optimizer, sync_every=self.cfg.sync_steps)
        else:
            fragments = model_fragments(model, self.cfg.fragments)
            outer = [
                torch.optim.SGD(f.parameters(), lr=self.cfg.outer_lr, momentum=self.cfg.outer_momentum,
                                nesterov=self.cfg.outer_nesterov)
                for f in fragments
            ]
            algorithm = DiLoCo(self.manager, fragments, optimizer, outer, sync_every=self.cfg.sync_steps)
            if self.diloco_state is not None:  # a loaded checkpoint's global weights and outer momentum
                self.diloco_state.attach(fragments)
        # Resumed from a checkpoint between two syncs: the next sync comes at the same step as the live
        # groups' (and as it would have without the restart), not a whole interval later.
        _torch_compat.set_inner_steps_since_sync(algorithm, sync_position(self.trainable.get_step(), self.cfg)[1])
        # A sync, and a heal in its quorum (a group resumed from an older checkpoint), runs in the
        # algorithm's hook after the optimizer step: these hooks run before and after it, so that the
        # metrics row of the step after a heal says so, as with begin_step.
        before = optimizer.register_step_post_hook(self._before_sync)
        try:
            with algorithm:
                after = optimizer.register_step_post_hook(self._after_sync)
                try:
                    yield algorithm
                finally:
                    after.remove()
        finally:
            before.remove()

    def _before_sync(self, *_) -> None:
        self._sync_start = time.perf_counter()
        self._healed_from = None

    def _after_sync(self, *_) -> None:
        self._note_heal(self._sync_start)

    def rejoin(self, algorithm) -> None:
        """A restarted semi-synchronous group, before its first step: take part in the live groups' next
        sync through torchft's own sync path, as if this group had just made the optimizer step that ends
        in it. The quorum there heals it from a peer (weights, inner optimizer, LR schedule, step; DiLoCo's
        fragments also their global weights and outer optimizer, registered with the Manager), after which
        its share of the sync's collectives equals that peer's, and it ends the sync's step with them."""
        from torchft.local_sgd import LocalSGD

        t = self.trainable
        start = time.perf_counter()
        self._healed_from = None
        try:
            if isinstance(algorithm, LocalSGD):
                algorithm.sync()
            else:  # DiLoCo syncs a fragment from its optimizer hook once its count of inner steps is due
                _torch_compat.diloco_sync_now(algorithm, t.optimizer)
        except TimeoutError:  # the Lighthouse's quorum (min_replicas above 1) never formed
            if self._healed_from is not None:
                raise
            raise TitanError(self._no_peer(
                f"no live replica group came to a sync within {self.cfg.quorum_timeout_seconds} s "
                "(fault_tolerance.quorum_timeout_seconds)")) from None
        if self._healed_from is None:
            raise TitanError(self._no_peer("no live replica group is left to heal from (the others finished or "
                                           "are gone)"))
        if self.manager.current_step() != self._healed_at_sync + 1:  # a group failed during the sync
            raise TitanError(f"{self.describe()} healed from a live peer, but the sync it joined did not commit "
                             "(a group failed during it); start it again to join the next one")
        t.lr_scheduler.step()  # the peer's schedule was sent from inside its optimizer step: before its own step
        t.set_step(t.get_step() + 1)  # the step the sync ended, as the peers count it
        self._note_heal(start)
        self.rejoining = False

    def _no_peer(self, why: str) -> str:
        return (f"{self.describe()} was restarted after training {self.restored_step} steps with "
                f"{self.cfg.semi_sync_method}, but {why}: it would train alone from its initial weights; restart "
                "the whole job from the newest checkpoint instead (docs/fault-tolerance.md)")

    def describe(self) -> str:
        return f"replica group {self.replica_id} of {self.cfg.group_size}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)


class Positions:
    """This rank's loader state after its newest committed step, at the newest checkpoint steps
    (so that a whole-job restart from a checkpoint finds where each group's stream stood then), and
    after its last sync with the other groups (where a semi-synchronous group restarted between syncs
    resumes); at checkpoint steps also the Manager's count of syncs (where a group resumed from that
    checkpoint counts from) and the last sync's position then (where a group that heals after a
    whole-job restart from that checkpoint resumes). One small JSON file, replaced atomically after
    every commit."""

    def __init__(self, path: Path, keep: int):
        self.path = path
        self.keep = keep
        self.latest: dict[str, Any] | None = None
        self.saved: dict[int, Any] = {}
        self.synced: dict[str, Any] | None = None
        self.syncs: dict[int, int] = {}
        self.synced_at: dict[int, dict[str, Any] | None] = {}
        if path.exists():
            data = json.loads(path.read_text())
            self.latest = data["latest"]
            self.saved = {int(k): v for k, v in data["at"].items()}
            self.synced = data.get("synced")
            self.syncs = {int(k): v for k, v in data.get("syncs_at", {}).items()}
            self.synced_at = {int(k): v for k, v in data.get("synced_at", {}).items()}

    def latest_step(self) -> int:
        return 0 if self.latest is None else int(self.latest["step"])

    def at(self, step: int) -> dict[str, Any] | None:
        if step in self.saved:
            return self.saved[step]
        if self.latest is not None and self.latest["step"] == step:
            return self.latest["loader"]
        if self.latest is None or self.latest["step"] < step:
            # Down since (or new): the steps in between were the other groups'; go on from here.
            return None if self.latest is None else self.latest["loader"]
        raise TitanError(
            f"{self.path} has no loader position for step {step} (it has {sorted(self.saved)} and "
            f"{self.latest['step']}): this group's data stream cannot resume there"
        )

    def syncs_at(self, step: int) -> int | None:
        """The Manager's count of syncs after checkpoint step ``step``; None when not recorded."""
        return self.syncs.get(step)

    def synced_loader(self, step: int) -> dict[str, Any] | None:
        """The loader state after the last step up to ``step`` that ended in a sync; None before the
        first. A whole-job restart from checkpoint ``step`` comes back to a record that went on past it."""
        synced = self.synced
        if synced is not None and synced["step"] > step:
            if step not in self.synced_at:
                raise TitanError(
                    f"{self.path} has no record of this group's last sync before step {step} (it has "
                    f"{sorted(self.synced_at)}): its data stream cannot resume there"
                )
            synced = self.synced_at[step]
        return None if synced is None else synced["loader"]

    def record(self, step: int, loader_state: dict[str, Any], keep_for_checkpoint: bool, synced: bool = False,
               syncs: int | None = None) -> None:
        self.latest = {"step": step, "loader": loader_state}
        if synced:
            self.synced = self.latest
        if keep_for_checkpoint:
            self.saved[step] = loader_state
            if syncs is not None:
                self.syncs[step] = syncs
            self.synced_at[step] = self.synced
            if self.keep > 0:
                for old in sorted(self.saved)[:-self.keep]:
                    del self.saved[old]
                    self.syncs.pop(old, None)
                    self.synced_at.pop(old, None)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"latest": self.latest, "at": {str(k): v for k, v in self.saved.items()},
                                   "synced": self.synced, "syncs_at": {str(k): v for k, v in self.syncs.items()},
                                   "synced_at": {str(k): v for k, v in self.synced_at.items()}}))
        os.replace(tmp, self.path)


def sync_position(step: int, ft) -> tuple[int, int]:
    """After training step ``step``: the syncs between the replica groups completed, counted as torchft's
    Manager counts them (one per committed quorum), and the steps trained since the last one. Without
    ``semi_sync_method`` every step syncs; LocalSGD syncs every ``sync_steps``; DiLoCo syncs one fragment
    every ``sync_steps // fragments`` steps, each a quorum of its own. A sync that failed (a group died
    during it) is not counted by torchft but is here: ``Positions`` keeps the exact count at checkpoints."""
    if ft.semi_sync_method == "none":
        every = 1
    elif ft.semi_sync_method == "local_sgd":
        every = ft.sync_steps
    else:
        every = ft.sync_steps // ft.fragments
    return divmod(step, every)


def model_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """``n`` modules that hold the model's parameters between them: consecutive ranges of its layers,
    what comes before the layers (embeddings) with the first, what comes after (norm, output) with the
    last. DiLoCo syncs them in turn."""
    children = list(model.named_children())
    names = [name for name, _ in children]
    if "layers" not in names:
        raise ConfigError(f"fault_tolerance.fragments needs a model with layers; {type(model).__name__} has none")
    layers = list(dict(children)["layers"].named_children())
    if n > len(layers):
        raise ConfigError(f"fault_tolerance.fragments = {n} exceeds the model's {len(layers)} layers")
    cut = names.index("layers")
    fragments = [torch.nn.Module() for _ in range(n)]
    for name, child in children[:cut]:
        fragments[0].add_module(name, child)
    for i, (name, layer) in enumerate(layers):
        fragments[i * n // len(layers)].add_module(f"layers_{name}", layer)
    for name, child in children[cut + 1:]:
        fragments[-1].add_module(name, child)
    return fragments
