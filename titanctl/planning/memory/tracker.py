"""Memory trackers for one training step: torch's MemTracker / FSDPMemTracker, plus where the peak is.

torch's trackers (``torch.distributed._tools``) see every tensor storage that an op creates, frees
or resizes, fake or real, and sort it into categories (parameters, gradients, optimizer state,
activations, ...). They keep the peak of the total; we add what the report needs on top:

- the phase the peak happened in (forward, backward, clip_grad_norm, optimizer step) and the
  innermost module that was running, for each step and each phase, keyed by the module's place in
  the model (its "anchor") so that runs of different depths can be extrapolated, and under a
  pipeline by the schedule's action running (``action``: forward or backward of which stage, for
  which place among the microbatches) so that runs of different microbatch counts can be too;
- several FSDP roots at once (pipeline stages are separate FSDP roots on one rank), and several
  top-level calls per step (a pipeline schedule calls each stage once per microbatch);
- no accounting for DTensor's shape propagation, which runs on our fake tensors (see below);
- no per-module peak refresh on every op (quadratic in depth; we do not use it);
- each op accounted in fewer steps than torch's ``__torch_dispatch__`` takes, with the same result
  (device queries answered as FakeTensorMode would, without dispatching to it; an op's outputs
  registered without a pytree walk where they are a tensor or a flat tuple of them);
- for a pipeline's second step, what was alive when each step's first schedule action began
  (``begin_action``), and a way to end a step there (``stop_at_first_action``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanctl._torch_compat import (
    ACTIVE_FAKE_MODE,
    ALL_GATHER_BASE_OP,
    FAKE_TENSOR,
    FSDP_MEM_TRACKER,
    FSDP_REF_TYPE,
    FSDP_TRACKER_STATE,
    MEM_REF_TYPE,
    MEM_TRACKER,
    MOD_TRACKER,
    REDUCE_SCATTER_BASE_OP,
    SHARDING_PROPAGATION,
    TREE_FLATTEN,
    TREE_MAP_ONLY,
    WAIT_TENSOR_OP,
    patched,
)
from titanctl.parallel.layouts.weight_init import canonical_name

FSDPMemTracker = FSDP_MEM_TRACKER.get()
MemTracker = MEM_TRACKER.get()
ModTracker = MOD_TRACKER.get()
tree_flatten = TREE_FLATTEN.get()
tree_map_only = TREE_MAP_ONLY.get()
active_fake_mode = ACTIVE_FAKE_MODE.get()
FakeTensor = FAKE_TENSOR.get()

TOTAL = "Total"

# torch's category names -> ours. FSDPMemTracker's and MemTracker's, for FSDP and other layouts.
CATEGORY = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Unsharded Param": "parameters (unsharded)",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "Unsharded Grad": "gradients (unsharded)",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "Buffer": "buffers",
    "Inputs": "inputs",
    "Other": "inputs",  # MemTracker: the only tensors we register from outside are the inputs
}
DDP_BUCKETS = "DDP gradient buckets"  # modelled, not tracked (see titanctl.planning.memory)
CATEGORIES = (*dict.fromkeys(CATEGORY.values()), DDP_BUCKETS)

PHASES = ("forward", "backward", "clip_grad_norm", "optimizer step")


@dataclass
class Peak:
    """The largest total seen in one (step, phase), its breakdown and the innermost module running."""

    total: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    module: str = ""


def _by_category(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name != TOTAL:
            out[CATEGORY.get(name, "temporaries")] += value
    return out


def _module_name(fqn: str) -> str:
    """'Transformer.layers.3._checkpoint_wrapped_module.attention' -> 'layers.3.attention'."""
    name = canonical_name(fqn + ".")[:-1]
    return name.split(".", 1)[1] if "." in name else "(model)"


_propagating = 0  # > 0 while DTensor works out an op's output shapes (not memory of the step)


@contextlib.contextmanager
def untracked_sharding_propagation():
    """Keep DTensor's shape propagation out of the trackers' accounts.

    DTensor runs each new (op, placements) combination once on fake tensors of the *global* shape to
    learn the output's shape. Without fake tensors that happens in a FakeTensorMode of its own, which
    the trackers ignore; under our FakeTensorMode it reuses ours, so the trackers would count those
    global-sized outputs as if the step allocated them (only on the first step: the results are
    cached). We mark those calls and the trackers skip their ops.
    """
    original = SHARDING_PROPAGATION.get()

    def marked(self, op_schema):
        global _propagating
        _propagating += 1
        try:
            return original(self, op_schema)
        finally:
            _propagating -= 1

    with patched(SHARDING_PROPAGATION, marked):
        yield


def layer_anchor(layer: int, n_layers: int, period: int) -> str:
    """Where a layer sits, in terms that stay true when the model gets deeper.

    Layers are grouped into runs of ``period`` (activation checkpointing of every N-th block repeats
    with period N, otherwise 1); the first two groups, the last two and the ones between ("mid")
    are told apart, and so is the layer's place inside its group.
    """
    group, groups = layer // period, -(-n_layers // period)
    if group < 2:
        where = f"g{group}"
    elif group >= groups - 2:
        where = f"g-{groups - group}"
    else:
        where = "mid"
    return f"{where}.{layer % period}"


def anchor_layer(anchor: str, n_layers: int, period: int) -> str:
    """The layer id an anchor stands for in a model of ``n_layers`` ("*" for the middle ones)."""
    where, offset = anchor.split(".")
    groups = -(-n_layers // period)
    if where == "mid":
        return "*"
    group = int(where[1:]) if not where.startswith("g-") else groups - int(where[2:])
    return str(group * period + int(offset))


class _LeafSafeModTracker(ModTracker):
    """ModTracker whose backward hooks skip leaf inputs.

    A pipeline stage's input is a leaf that requires grad, and its backward runs through
    ``torch.autograd.grad``, under which the "all inputs" gradient hook ModTracker puts on a
    module's inputs fails for leaves. Without them the module leaves the set of running modules at
    the end of the backward instead: a later attribution, the same memory.
    """

    def _fw_pre_hook(self, mod, input):
        flat, _ = tree_flatten(input)
        kept = tuple(a for a in flat if not (isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf))
        super()._fw_pre_hook(mod, kept)


_LAYER = re.compile(r"^layers\.(\d+)(\.|$)")
# Asks a tensor for its device: allocates nothing, and is half of all the ops the trackers see
# (the autograd engine and DTensor ask for every tensor they touch).
_DEVICE_QUERY = torch.ops.prim.device.default


_META = torch.device("meta")
_WAIT_TENSOR = WAIT_TENSOR_OP.get()


class _StepPeaks:
    """Mixin over MemTracker / FSDPMemTracker: peaks per (step, phase, place in the model)."""

    # torch's categories for what an op makes: in the optimizer step, in backward (outside AC's
    # recomputation), else (set by the subclasses).
    _OPT = _TEMP = _ACT = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """torch's trackers' accounting of an op (MemTracker.__torch_dispatch__ and FSDPMemTracker's),
        in fewer steps: the same storages registered in the same order, the same categories."""
        if func is _DEVICE_QUERY:
            tensor = args[0] if len(args) == 1 else None
            if type(tensor) is FakeTensor:  # FakeTensorMode's own answer, without dispatching to it
                return _META if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
            return func(*args, **(kwargs or {}))
        if _propagating:
            return func(*args, **(kwargs or {}))
        if DTensor in types:  # let DTensor desugar into local ops, which are tracked
            return NotImplemented
        if func is _WAIT_TENSOR and active_fake_mode():
            res = args[0]  # the fake kernel would return a new tensor; the real one returns its input
        else:
            res = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode_on_entry:  # DTensor's own shape propagation
            return res
        is_bw = self._mod_tracker.is_bw
        reftype = self._OPT if self._in_opt else self._TEMP if is_bw and not self._in_ac else self._ACT
        self._track_communication_buffers(func, args)
        track = self._track
        if isinstance(res, torch.Tensor):
            track(reftype, res)
        elif (type(res) is tuple or type(res) is list) and all(r is None or isinstance(r, torch.Tensor) for r in res):
            for r in res:  # the pytree walk's leaves, in its order
                if r is not None:
                    track(reftype, r)
        else:
            tree_map_only(torch.Tensor, partial(track, reftype), res)
        self._update_peak_stats(None)
        return res

    def _track_communication_buffers(self, func, args) -> None:
        pass

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        """torch's own, except that gradient hooks go on the parameters that train only: a frozen one
        (a LoRA run's base) refuses hooks. It is counted as a parameter all the same."""
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            grad = MEM_REF_TYPE.get().GRAD
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    def on_grad(g, grad=grad):
                        self._update_and_maybe_create_winfos(g, grad)

                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(on_grad),
                        param.register_post_accumulate_grad_hook(lambda p, on_grad=on_grad: on_grad(p.grad)),
                    )
        return memory

    def _init_step_peaks(self, n_layers: int, period: int) -> None:
        self._mod_tracker = _LeafSafeModTracker()
        self.step = 0
        self.phase = "forward"  # the driver sets this; forward/backward are told apart by autograd
        self.n_layers, self.period = n_layers, period
        # (step, phase, anchor) -> Peak; anchor: the innermost running module, or for anything in a
        # block "layers.<layer_anchor>" (so runs of different depths can be compared); "" outside
        # any module. Peak.module keeps the innermost module's real name.
        self.peaks: dict[tuple[int, str, str], Peak] = {}
        self._anchors: dict[str, tuple[str, str]] = {}
        # The pipeline action running (set by planning.memory.pipeline_peers.label_actions), appended to
        # anchors as "@action": "" outside any.
        self.action = ""
        # Bytes per category when each step's first schedule action began (see begin_action).
        self.action_start: dict[int, dict[str, int]] = {}
        self.stop_at_first_action = 0  # a step that ends (FirstActionReached) where its first action begins
        self.set_up_after_action = False  # a stage was set up after its step's first action had begun

    def _current_phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        if self.phase == "forward":
            return "backward" if self._mod_tracker.is_bw else "forward"
        return self.phase

    def _anchor(self, fqn: str) -> tuple[str, str]:
        """ModTracker's name -> (canonical module name, anchor)."""
        found = self._anchors.get(fqn)
        if found is None:
            name = _module_name(fqn)
            match = _LAYER.match(name)
            anchor = name
            if match:
                # Whole blocks: in backward, which submodule an op is charged to depends on the order
                # autograd hooks fire in, which is not stable between runs of different depths.
                anchor = f"layers.<{layer_anchor(int(match.group(1)), self.n_layers, self.period)}>"
            found = self._anchors[fqn] = (name, anchor)
        return found

    def _update_peak_stats(self, peak_state) -> None:
        # torch's version also refreshes every tracked module's own peak, looping over all modules
        # on every op (quadratic in the layer count); we keep the global peak and our own.
        snaps = self._curr_mem_snap
        total = 0
        for device, snap in snaps.items():
            total += snap[TOTAL]
            if self._peak_mem.get(device, 0) < snap[TOTAL]:
                self._peak_mem[device] = snap[TOTAL]
                self._peak_mem_snap[device] = dict(snap)
        # The deepest running module; of several equally deep (in backward, siblings whose gradients
        # are pending together), the first by name, not by the order of a set.
        innermost, depth = "", -1
        for parent in self._mod_tracker.parents:
            if parent != "Global":
                level = parent.count(".")
                if level > depth or (level == depth and parent < innermost):
                    innermost, depth = parent, level
        name, anchor = self._anchor(innermost) if innermost else ("", "")
        if self.action:
            anchor = f"{anchor}@{self.action}"
        key = (self.step, self._current_phase(), anchor)
        peak = self.peaks.get(key)
        if peak is None or total > peak.total:
            merged: dict = {}
            for snap in snaps.values():
                for k, v in snap.items():
                    merged[k] = merged.get(k, 0) + v
            self.peaks[key] = Peak(total, _by_category(merged), name)

    def begin_action(self, label: str) -> None:
        """A pipeline schedule action starts (``pipeline_peers.label_actions``)."""
        if self.step not in self.action_start:
            self.action_start[self.step] = self.current()
            if self.step == self.stop_at_first_action:
                raise FirstActionReached
        self.action = label

    def begin_set_up(self, label: str) -> None:
        """A pipeline stage's first-step set-up starts (shape inference, message buffers)."""
        if self.step in self.action_start:
            self.set_up_after_action = True
        self.action = label

    def current(self) -> dict[str, int]:
        """Bytes per category right now."""
        merged: dict = {}
        for dev in self._curr_mem_snap.values():
            for k, v in dev.items():
                merged[k] = merged.get(k, 0) + v
        return _by_category(merged)

    def track_step_inputs(self, tensors) -> None:
        if isinstance(self, FSDPMemTracker):
            self.track_inputs(tuple(tensors))
        else:
            self.track_external(*tensors)

    def next_step(self) -> None:
        self.reset_mod_stats()
        self.step += 1
        self.action = ""

    def _forget_if_called_again(self, module) -> None:
        # A pipeline schedule calls each stage once per microbatch; torch's trackers take a second
        # top-level call for a second iteration and refuse it. We do not use their per-module
        # statistics, so a new call simply starts them afresh.
        if not self._mod_tracker.is_bw and module in self.memory_tracking:
            del self.memory_tracking[module]


class StepMemTracker(_StepPeaks, MemTracker):
    """MemTracker for layouts without FSDP (single process, TP, PP)."""

    _OPT, _TEMP, _ACT = (getattr(MEM_REF_TYPE.get(), name) for name in ("OPT", "TEMP", "ACT"))

    def __init__(self, parts, optimizer, inputs, n_layers: int, period: int) -> None:
        super().__init__()
        self._init_step_peaks(n_layers, period)
        self.track_external(*parts, optimizer, *inputs)

    def _pre_fw_hook(self, module, inputs) -> None:
        self._forget_if_called_again(module)
        super()._pre_fw_hook(module, inputs)


class StepFSDPMemTracker(_StepPeaks, FSDPMemTracker):
    """FSDPMemTracker over one or several FSDP roots (several pipeline stages on one rank)."""

    _OPT, _TEMP, _ACT, _ALL_GATHER, _REDUCE_SCATTER = (
        getattr(FSDP_REF_TYPE.get(), name) for name in ("OPT", "TEMP", "ACT", "ALL_GATHER", "REDUCE_SCATTER")
    )
    _GATHERING = (FSDP_TRACKER_STATE.get().PRE_FW, FSDP_TRACKER_STATE.get().PRE_BW)
    _REDUCING = FSDP_TRACKER_STATE.get().POST_BW
    _ALL_GATHER_OP, _REDUCE_SCATTER_OP = ALL_GATHER_BASE_OP.get(), REDUCE_SCATTER_BASE_OP.get()

    def _track_communication_buffers(self, func, args) -> None:
        """FSDP's all-gather outputs and reduce-scatter inputs, as FSDPMemTracker.__torch_dispatch__."""
        if func is self._ALL_GATHER_OP and self._fsdp_state in self._GATHERING:
            self._update_and_maybe_create_winfos(args[0], self._ALL_GATHER, update_existing=True)
        if func is self._REDUCE_SCATTER_OP and self._fsdp_state == self._REDUCING:
            self._update_and_maybe_create_winfos(args[1], self._REDUCE_SCATTER, update_existing=True)

    def __init__(self, parts, optimizer, inputs, n_layers: int, period: int) -> None:
        super().__init__(parts[0], optimizer)
        self._init_step_peaks(n_layers, period)
        if len(parts) > 1:
            # Instrumentation walks _root_mod.modules(): a container reaches every stage's modules.
            self._root_mod = nn.ModuleList(parts)
        self.track_inputs(tuple(inputs))

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            self._forget_if_called_again(fsdp_mod)
            return inner(*args, **kwargs)

        return pre_forward


class FirstActionReached(BaseException):
    """A step run only up to its first pipeline action has reached it (``stop_at_first_action``).

    A BaseException, so that the pipeline schedule's ``except Exception`` (which logs the schedule
    as failed) lets it pass."""


class NullTracker(contextlib.nullcontext):
    """The tracker's interface, tracking nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.phase, self.peaks, self.action = 0, "forward", {}, ""
        self.action_start, self.stop_at_first_action, self.set_up_after_action = {}, 0, False

    def begin_action(self, label: str) -> None:
        self.action = label

    def begin_set_up(self, label: str) -> None:
        self.action = label

    def current(self) -> dict[str, int]:
        return {}

    def track_step_inputs(self, tensors) -> None:
        pass

    def next_step(self) -> None:
        pass


def make_tracker(parts: list[nn.Module], optimizer, inputs, *, fsdp: bool, n_layers: int, period: int):
    cls = StepFSDPMemTracker if fsdp else StepMemTracker
    return cls(parts, optimizer, inputs, n_layers, period)
