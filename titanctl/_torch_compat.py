"""Every private torch name titanctl relies on, in one place.

Some features need torch internals that no public API offers (the reason is written above each
entry). They are all reached through this module: other modules call ``ENTRY.get()`` or one of
the helpers at the bottom, never a ``_``-prefixed torch name themselves (a test checks that).

Nothing is imported until a feature asks for its entry, so importing this module costs nothing
and a torch without one of these names fails only the feature that needs it, with a
``TorchInternalsError`` that names the feature and the torch version (not an ImportError at
start-up). ``tests/unit/test_torch_compat.py`` looks every entry up, so a torch upgrade that moves
one fails that test with the list of what moved, before any user's run does.

Where torch releases differ, an entry names the releases it belongs to (``torch_versions``, e.g.
"<2.15"), the helper at the bottom picks the way this torch needs, and only the entries of this
torch are looked up. docs/development.md (torch versions) lists the releases checked and what differs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from titanctl.errors import TorchInternalsError

TESTED_TORCH = "2.13"  # the torch these entries were written against and are tested on

_NO_VALUE = object()


def torch_version() -> str:
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)

    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed)"


def _major_minor(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(match[1]), int(match[2])


def torch_at_least(release: str) -> bool:
    """Whether this torch is ``release`` ("2.15") or newer; pre-releases count as their release."""
    return _major_minor(torch_version()) >= _major_minor(release)


def _in_versions(spec: str | None) -> bool:
    """Whether this torch is in ``spec``: None (every release), "<X.Y", ">=X.Y", or both joined by a
    comma (">=2.12,<2.15")."""
    if spec is None:
        return True
    return all(_in_range(part) for part in spec.split(","))


def _in_range(spec: str) -> bool:
    if spec.startswith(">="):
        return torch_at_least(spec[2:])
    if spec.startswith("<"):
        return not torch_at_least(spec[1:])
    raise ValueError(f"torch_versions {spec!r} is not '<X.Y' or '>=X.Y'")


def _lookup(path: str) -> Any:
    """``a.b.c`` -> the object, importing submodules on the way (raises ImportError/AttributeError).

    A submodule wins over a package attribute of the same name (``_composable.replicate`` is
    both a module and, in the package, the function it defines).
    """
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=2):
        if inspect.ismodule(obj):
            with contextlib.suppress(ImportError):
                obj = importlib.import_module(".".join(parts[:i]))
                continue
        obj = getattr(obj, name)
    return obj


@dataclass(frozen=True)
class Private:
    """One private name: ``path`` (dotted, from the top package), the feature that needs it, and
    optionally an attribute that the class at ``path`` sets on its instances (``instance_attr``,
    found in the class's source) or the value a name constant must have (``equals``), and the torch
    releases that have it (``torch_versions``: "<X.Y" or ">=X.Y"; None: all)."""

    path: str
    feature: str
    instance_attr: str | None = None
    equals: Any = _NO_VALUE
    torch_versions: str | None = None

    @property
    def applies(self) -> bool:
        """Whether this torch release is one that has (and needs) the name."""
        return _in_versions(self.torch_versions)

    @property
    def name(self) -> str:
        return f"{self.path}.{self.instance_attr}" if self.instance_attr else self.path

    def problem(self) -> str | None:
        """Why this torch does not provide the name, or None if it does."""
        try:
            obj = _lookup(self.path)
        except (ImportError, AttributeError) as e:
            return f"{type(e).__name__}: {e}"
        if self.instance_attr is not None and not _sets_attribute(obj, self.instance_attr):
            return f"{self.path} no longer sets .{self.instance_attr}"
        if self.equals is not _NO_VALUE and obj != self.equals:
            return f"{self.path} is {obj!r}, not {self.equals!r}"
        return None

    def get(self) -> Any:
        """The object (for an ``instance_attr`` entry: the class), or TorchInternalsError."""
        if self in _FOUND:
            return _FOUND[self]
        problem = self.problem()
        if problem is not None:
            raise self.missing(problem)
        _FOUND[self] = obj = _lookup(self.path)
        return obj

    def of(self, obj: Any) -> Any:
        """The attribute this entry names (its ``instance_attr``, else its last part) of ``obj``.

        Only a getattr, no lookup of the class's source: cheap enough for any path, and it allocates
        nothing (a first use inside a measured step must not move the garbage collector's timing)."""
        attr = self.instance_attr or self.path.rsplit(".", 1)[1]
        try:
            return getattr(obj, attr)
        except AttributeError:
            raise self.missing(f"{type(obj).__name__} has no .{attr}") from None

    def missing(self, problem: str) -> TorchInternalsError:
        return TorchInternalsError(
            f"{self.feature} needs torch's internal {self.name}, which torch {torch_version()} does not "
            f"have ({problem}); titanctl is written against torch {TESTED_TORCH}"
        )

    def check(self) -> None:
        self.get()


_FOUND: dict[Private, Any] = {}
ENTRIES: list[Private] = []


def _sets_attribute(cls: Any, attr: str) -> bool:
    """Whether the code of ``cls`` or a base class refers to ``.attr`` (instance attributes are
    not visible on the class itself)."""
    pattern = re.compile(rf"\.{re.escape(attr)}\b")
    return any(pattern.search(source) for source in _class_sources(cls))


def _class_sources(cls: Any) -> Iterator[str]:
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass is object:
            continue
        try:
            yield inspect.getsource(klass)
        except (OSError, TypeError):
            # No class source (C classes; classes whose __module__ names a re-exporting package):
            # the files their methods come from.
            files = {inspect.getsourcefile(f) for f in vars(klass).values() if inspect.isfunction(f)}
            for file in sorted(f for f in files if f):
                with open(file, encoding="utf-8") as text:
                    yield text.read()


def _private(
    path: str, feature: str, *, instance_attr: str | None = None, equals: Any = _NO_VALUE,
    torch_versions: str | None = None,
) -> Private:
    entry = Private(path, feature, instance_attr, equals, torch_versions)
    ENTRIES.append(entry)
    return entry


def missing() -> list[str]:
    """Every entry of this torch's releases that it lacks, as ``name (feature): why``; empty on
    every torch in pyproject.toml's range."""
    return [f"{e.name} ({e.feature}): {p}" for e in ENTRIES if e.applies and (p := e.problem()) is not None]


def require(condition: bool, feature: str, what: str) -> None:
    """A torch internal is there but behaves differently (a signature or a schema changed)."""
    if not condition:
        raise TorchInternalsError(
            f"{feature}: torch {torch_version()} internals changed ({what}); titanctl is written against "
            f"torch {TESTED_TORCH}"
        )


# --- oneDNN linears on CPU ------------------------------------------------------------------------
_ONEDNN = "training.cpu_linear = 'onednn'"
# oneDNN's matmul with nn.Linear's weight layout (x @ W^T). torch calls it only from its inference
# fusion passes (frozen weights); no public API runs an fp32 training matmul on CPU through oneDNN.
ONEDNN_LINEAR = _private("torch.ops.mkldnn._linear_pointwise.default", _ONEDNN)
# The same result as a tensor that is not a view of oneDNN's 2-D output (what torch's own linear
# returns for 3-D inputs): FSDP warns about modules that return views.
UNSAFE_VIEW = _private("torch.ops.aten._unsafe_view.default", _ONEDNN)

# Whether torch sends bf16 / fp16 matmuls on this CPU to oneDNN (AVX-512 and up, honouring
# ONEDNN_MAX_CPU_ISA) rather than its generic loop, which is ~100x slower: no public API says.
_SLOW_16BIT = "the note that 16-bit compute is slow on this CPU"
MKLDNN_BF16_SUPPORTED = _private("torch.ops.mkldnn._is_mkldnn_bf16_supported", _SLOW_16BIT)
MKLDNN_FP16_SUPPORTED = _private("torch.ops.mkldnn._is_mkldnn_fp16_supported", _SLOW_16BIT)


# --- activation checkpointing -------------------------------------------------------------------
_AC = "activation_checkpoint.mode"
_SAC = "activation_checkpoint.selective_ac_option = 'op'"
# Wraps a block as a module that recomputes its forward in backward; torch.utils.checkpoint (public)
# is a function, and FSDP, TP and compile need a module to wrap (torchtitan uses the same wrapper).
CHECKPOINT_WRAPPER = _private(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper", _AC
)
# The ATen ops whose outputs op-level selective AC keeps: SDPA lowers to one of these kernels per
# backend and they exist only under private names; TP's reduce-scatter runs as the functional op.
SAC_SAVE_OPS = (
    _private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default", _SAC),
    _private("torch.ops.aten._scaled_dot_product_efficient_attention.default", _SAC),
    _private("torch.ops.aten._scaled_dot_product_flash_attention.default", _SAC),
    _private("torch.ops.aten._scaled_dot_product_cudnn_attention.default", _SAC),
    _private("torch.ops._c10d_functional.reduce_scatter_tensor.default", _SAC),
)

# --- parameter names ----------------------------------------------------------------------------
_NAMES = "canonical parameter names (checkpoints, weight init)"
# The parts wrappers insert into parameter names, which canonical names leave out; torch names
# them only in private constants (checkpoint wrapper, torch.compile's OptimizedModule, FSDP1).
CHECKPOINT_WRAPPED_MODULE = _private(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE", _NAMES,
    equals="_checkpoint_wrapped_module",
)
# (see above) torch.compile(module) keeps the compiled module as ._orig_mod.
COMPILED_ORIG_MOD = _private("torch._dynamo.eval_frame.OptimizedModule", _NAMES, instance_attr="_orig_mod")
# (see above) FSDP1's wrapper attribute; FSDP2 (what titanctl uses) adds none.
FSDP_WRAPPED_MODULE = _private(
    "torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE", _NAMES, equals="_fsdp_wrapped_module"
)
# DDP's "module." comes from its public attribute, so it needs no entry.
WRAPPER_NAME_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")

# --- data parallel ------------------------------------------------------------------------------
_DDP = "DDP (parallelism.data_parallel_replicate_degree > 1 without FSDP)"
# Composable DDP: keeps parameter names unchanged; the public DistributedDataParallel prefixes
# them with "module." and is a wrapper FSDP/TP cannot compose with.
REPLICATE = _private("torch.distributed._composable.replicate.replicate", _DDP)

# --- mixture of experts --------------------------------------------------------------------------
# One GEMM per expert over tokens sorted by expert (offsets = cumulative counts), forward and
# backward, on CPU (fp32, bf16) and CUDA; torch 2.13 has no public name for it.
GROUPED_MM = _private("torch._grouped_mm", "Mixture-of-Experts layers (routed experts)")
# The autograd engine's current task: -1 outside backward, so a forward that runs with another id is
# activation checkpointing's recomputation (whose tokens the MoE layer has counted already).
GRAPH_TASK_ID = _private(
    "torch._C._current_graph_task_id", "Mixture-of-Experts token counts under activation checkpointing"
)

# --- device mesh --------------------------------------------------------------------------------
_MESH = "flattened mesh dims (FSDP over dp_shard x cp, the data-parallel mesh of HSDP)"
# One mesh dim spanning several (e.g. dp_shard x cp); DeviceMesh has no public flatten in 2.13.
MESH_FLATTEN = _private("torch.distributed.device_mesh.DeviceMesh._flatten", _MESH)

# --- context parallel ---------------------------------------------------------------------------
_CP = "context parallel on CPU"
_CP_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"
# The table of SDPA ops that torch's CP dispatcher sends to ring attention: it names only CUDA
# kernels, so the CPU kernel is added to it (see titanctl.parallel.layouts.context_parallel).
CP_CUSTOM_OPS = _private(f"{_CP_ATTENTION}.custom_ops", _CP)
# Merges CP_CUSTOM_OPS into DTensor's dispatcher while CP is on; checked (not called): without it
# the table above would have no effect.
CP_ENABLE_DISPATCHER = _private(f"{_CP_ATTENTION}._enable_cp_dtensor_dispatcher", _CP)
# torch's ring attention, forward and backward; device-agnostic (the kernel is an argument) but
# not public.
CP_RING_FORWARD = _private(f"{_CP_ATTENTION}._templated_ring_attention", _CP)
CP_RING_BACKWARD = _private(f"{_CP_ATTENTION}._templated_ring_attention_backward", _CP)
# allgather vs alltoall ring exchange; defined in the private module, not re-exported.
CP_SET_ROTATE_METHOD = _private(f"{_CP_ATTENTION}.set_rotate_method", "parallelism.context_parallel_rotate_method")
# The CPU flash-attention kernel SDPA lowers to, and its backward: what CPU ring attention runs.
CPU_FLASH_SDPA = _private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default", _CP)
CPU_FLASH_SDPA_BACKWARD = _private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default", _CP)
# The argument list of an op overload, to check the kernels' signatures before routing them;
# OpOverload keeps its schema only in ._schema.
OP_SCHEMA = _private("torch._ops.OpOverload", _CP, instance_attr="_schema")
# DTensor's op dispatcher: unwraps a DTensor op call into local tensors and wraps the results,
# as every custom-op handler in the CP table must; no public equivalent.
DTENSOR_OP_DISPATCHER = _private("torch.distributed.tensor.DTensor._op_dispatcher", _CP)
# The spec (mesh, placements, global shape) of the ring's outputs, which the dispatcher needs.
DTENSOR_SPEC = _private("torch.distributed.tensor._dtensor_spec.DTensorSpec", _CP)
TENSOR_META = _private("torch.distributed.tensor._dtensor_spec.TensorMeta", _CP)
# The global shape and stride of a sharded tensor from its local piece.
COMPUTE_GLOBAL_TENSOR_INFO = _private("torch.distributed.tensor._utils.compute_global_tensor_info", _CP)
# An all-gather that autograd differentiates (backward: a reduce-scatter of the gradients): context
# parallel of Gated DeltaNet layers gathers every rank's chunk states and conv tails with it (and
# benchmarks/cp_steps.py the keys and values of the route the masked ring replaced). No public equivalent
# (torch.distributed.nn.functional.all_gather is deprecated in its favour).
_CP_STATE_GATHER = "context parallel of Gated DeltaNet layers (Qwen3.5)"
# Its name since 2.13; 2.11 and 2.12 have only the older one (deprecated, with a warning, from 2.13).
CP_ALL_GATHER_AUTOGRAD = _private(
    "torch.distributed._functional_collectives.all_gather_single_autograd", _CP_STATE_GATHER, torch_versions=">=2.13"
)
CP_ALL_GATHER_AUTOGRAD_BEFORE_2_13 = _private(
    "torch.distributed._functional_collectives.all_gather_tensor_autograd", _CP_STATE_GATHER, torch_versions="<2.13"
)

# --- expert parallel ----------------------------------------------------------------------------
# An all-to-all with uneven splits that autograd differentiates (backward: the all-to-all back):
# expert parallelism sends tokens to their experts' ranks with it. No public equivalent.
EP_ALL_TO_ALL_AUTOGRAD = _private(
    "torch.distributed._functional_collectives.all_to_all_single_autograd", "parallelism.expert_parallel_degree"
)

# --- tensor parallel ----------------------------------------------------------------------------
_ASYNC_TP = "parallelism.enable_async_tensor_parallel"
# Inductor's micro-pipeline pass that overlaps TP's collectives with matmuls: a private flag.
INDUCTOR_MICRO_PIPELINE_TP = _private("torch._inductor.config._micro_pipeline_tp", _ASYNC_TP)
# Symmetric memory for the TP group, which that pass needs; torch has no public switch for it.
ENABLE_SYMM_MEM_FOR_GROUP = _private("torch.distributed._symmetric_memory.enable_symm_mem_for_group", _ASYNC_TP)

# --- float8 -------------------------------------------------------------------------------------
_F8 = "float8.enable_float8_linear"
# The float8 matmul torchao runs; calling it once tells whether this device has a kernel for it.
SCALED_MM = _private("torch._scaled_mm", _F8)
# A DTensor's local shard as stored; to_local() returns an autograd view of it.
DTENSOR_LOCAL_TENSOR = _private("torch.distributed.tensor.DTensor", _F8, instance_attr="_local_tensor")
# The plain weight inside torchao's float8 all-gather wrapper, which offers no accessor for it.
FLOAT8_WEIGHT_INNER = _private(
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor", "float8.enable_fsdp_float8_all_gather",
    instance_attr="_tensor",
)
# The logger through which torch's pytree warns about torchao's enum at import (filtered out).
PYTREE_LOGGER = _private("torch.utils._pytree", _F8)
# A SpanMask (titanctl.models.common.span_mask) as a pytree node, so that the pipeline's microbatch split cuts
# its document starts along the batch like the inputs (torch.utils._pytree has no public twin).
REGISTER_PYTREE_NODE = _private("torch.utils._pytree.register_pytree_node", "block_causal under pipeline parallel")

# --- pipeline parallel --------------------------------------------------------------------------
_CSV = "parallelism.pipeline_parallel_schedule_csv"
# Parses a schedule action such as "0F1" (stage, kind, microbatch); torch has no public parser.
PIPELINE_ACTION = _private("torch.distributed.pipelining.schedules._Action", _CSV)
# The schedule that runs a list of actions read from a CSV file; only this private class does.
PIPELINE_RUNTIME = _private("torch.distributed.pipelining.schedules._PipelineScheduleRuntime", _CSV)
# Loads a compute-only CSV into that schedule and adds the communication actions.
PIPELINE_LOAD_CSV = _private("torch.distributed.pipelining.schedules._PipelineScheduleRuntime._load_csv", _CSV)

# --- torchft's semi-synchronous training ---------------------------------------------------------
_SEMI = "fault_tolerance.semi_sync_method = 'local_sgd' or 'diloco' (torchft 0.2)"
# The inner steps since the last sync: a group resumed between syncs sets it, so that it syncs at the
# live groups' step rather than a whole interval later.
LOCAL_SGD_LOCAL_STEP = _private("torchft.local_sgd.LocalSGD", _SEMI, instance_attr="_local_step")
DILOCO_LOCAL_STEP = _private("torchft.local_sgd.DiLoCo", _SEMI, instance_attr="_local_step")
DILOCO_SYNC_EVERY = _private("torchft.local_sgd.DiLoCo", _SEMI, instance_attr="_sync_every")
# DiLoCo's optimizer hook, which runs a fragment's sync once it is due: DiLoCo has no public sync call,
# and a restarted group joins the live groups' next sync through it.
DILOCO_STEP_POST_HOOK = _private("torchft.local_sgd.DiLoCo._step_post_hook", _SEMI)
# The save/load pair that each DiLoCo fragment registers with the Manager for torchft's own heals (its
# global weights and outer optimizer): titanctl's checkpoints save and restore the same state through
# it. The Manager offers registration but no public way to read a registered pair back.
MANAGER_STATE_DICT_FNS = _private("torchft.manager.Manager", _SEMI, instance_attr="_user_state_dicts")
MANAGER_LOAD_STATE_DICT_FNS = _private("torchft.manager.Manager", _SEMI, instance_attr="_load_state_dict_fns")
DILOCO_FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"  # the key fragment i registers under (torchft 0.2)


# --- Flight Recorder ----------------------------------------------------------------------------
_FR = "the Flight Recorder dump (comm.trace_buf_size, inspect-trace)"
# The Flight Recorder's buffer as JSON bytes: the only way to read it from inside the process.
DUMP_FR_TRACE_JSON = _private("torch._C._distributed_c10d._dump_fr_trace_json", _FR)
# Every process group of this process with its name, to fill in the group layout gloo leaves
# empty in the dump; torch lists no groups publicly.
PROCESS_GROUP_NAMES = _private("torch.distributed.distributed_c10d._world.pg_names", _FR)

# --- profiling ----------------------------------------------------------------------------------
_SNAPSHOT = "profiling.enable_memory_snapshot"
# CUDA memory snapshots: documented in torch's memory guide but only under these private names.
RECORD_MEMORY_HISTORY = _private("torch.cuda.memory._record_memory_history", _SNAPSHOT)
DUMP_MEMORY_SNAPSHOT = _private("torch.cuda.memory._dump_snapshot", _SNAPSHOT)

# --- checkpoints --------------------------------------------------------------------------------
_DCP_READ = "reading a DCP checkpoint's .metadata"
# Classes a DCP .metadata pickle names, which the safe unpickler must recognise by name.
DCP_STORAGE_INFO = _private("torch.distributed.checkpoint.filesystem._StorageInfo", _DCP_READ)
DCP_MEM_FORMAT_ENCODING = _private("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", _DCP_READ)
# The LR scheduler's step counter, a key of its (public) state_dict that resume sets back by one.
LR_SCHEDULER_STEP_COUNT = _private(
    "torch.optim.lr_scheduler.LRScheduler", "resuming the LR schedule", instance_attr="_step_count"
)
LR_SCHEDULER_STEP_COUNT_KEY = "_step_count"

# --- memory estimation (titanctl.planning.memory) --------------------------------------------------
_MEM = "estimate-memory"
# Tensors without storage, on which a whole training step runs to measure its memory.
FAKE_TENSOR_MODE = _private("torch._subclasses.fake_tensor.FakeTensorMode", _MEM)
# FakeTensorMode's dispatch cache key, which titanctl.planning.memory.fake builds faster (the same key):
# the fake tensor class, the metadata whose fields the key lists, the method that builds the key's
# values from an op's arguments, and the memory format the metadata records.
FAKE_TENSOR = _private("torch._subclasses.fake_tensor.FakeTensor", _MEM)
FAKE_TENSOR_METADATA = _private("torch._subclasses.fake_tensor.TensorMetadata", _MEM)
PREP_ARGS_FOR_HASH = _private("torch._subclasses.fake_tensor.FakeTensorMode._prep_args_for_hash", _MEM)
SUGGEST_MEMORY_FORMAT = _private("torch._prims_common.suggest_memory_format", _MEM)
# The profiler's allocation events (--validate counts the allocator's bytes from them).
PROFILER_ALLOCATION_EVENT = _private("torch._C._profiler._EventType.Allocation", _MEM)
# torch's memory trackers, which sort every storage of a step into parameters, gradients,
# optimizer state, activations...; they exist only in torch.distributed._tools.
MEM_TRACKER = _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM)
FSDP_MEM_TRACKER = _private("torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", _MEM)
MOD_TRACKER = _private("torch.distributed._tools.mod_tracker.ModTracker", _MEM)
# Flattens a module's inputs in the tracker's forward pre-hook (torch.utils._pytree has no public twin).
TREE_FLATTEN = _private("torch.utils._pytree.tree_flatten", _MEM)
# The trackers' hooks and state that titanctl's subclasses override or read: the forward pre-hooks
# (to skip leaf inputs and allow a stage to be called per microbatch), the peak update (torch's
# refreshes every module's peak on every op) and the snapshots it updates.
MEM_TRACKER_HOOKS = (
    _private("torch.distributed._tools.mod_tracker.ModTracker._fw_pre_hook", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker._pre_fw_hook", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker._update_peak_stats", _MEM),
    _private("torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker._fsdp_state_pre_forward", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_curr_mem_snap"),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_peak_mem"),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_peak_mem_snap"),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_in_opt"),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_mod_tracker"),
    _private("torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", _MEM, instance_attr="_root_mod"),
    # A frozen parameter (a LoRA run's base) refuses gradient hooks: the tracker's registration of a
    # module's parameters is overridden to hook only those that train.
    _private("torch.distributed._tools.mem_tracker.MemTracker._track_module_params_and_buffers", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_param_to_grad_hook_handles"),
)
# How a tensor-parallel style splits a linear's parameters, overridden for a LoRA linear so that its
# adapters are split with the weight they add to (torch's styles split by parameter kind only).
_LORA_TP = "lora.enable with parallelism.tensor_parallel_degree > 1"
LORA_TP_PARTITION = (
    _private("torch.distributed.tensor.parallel.ColwiseParallel._partition_linear_fn", _LORA_TP),
    _private("torch.distributed.tensor.parallel.RowwiseParallel._partition_linear_fn", _LORA_TP),
)
# The trackers' accounting of each op (their __torch_dispatch__), which titanctl's subclasses do in fewer
# steps with the same result: torch's categories and FSDP's states, the methods that register an op's
# output storages and FSDP's communication buffers, the state they read, the fake mode check, the
# collectives FSDP's tracker treats apart, and the pytree walk over an op's outputs.
MEM_REF_TYPE = _private("torch.distributed._tools.mem_tracker._MemRefType", _MEM)
FSDP_REF_TYPE = _private("torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType", _MEM)
FSDP_TRACKER_STATE = _private("torch.distributed._tools.fsdp2_mem_tracker._FSDPState", _MEM)
MEM_TRACKER_DISPATCH = (
    _private("torch.distributed._tools.mem_tracker.MemTracker._track", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker._update_and_maybe_create_winfos", _MEM),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_fake_mode_on_entry"),
    _private("torch.distributed._tools.mem_tracker.MemTracker", _MEM, instance_attr="_in_ac"),
    _private("torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", _MEM, instance_attr="_fsdp_state"),
)
ACTIVE_FAKE_MODE = _private("torch._guards.active_fake_mode", _MEM)
ALL_GATHER_BASE_OP = _private("torch.ops.c10d._allgather_base_.default", _MEM)
REDUCE_SCATTER_BASE_OP = _private("torch.ops.c10d._reduce_scatter_base_.default", _MEM)
WAIT_TENSOR_OP = _private("torch.ops._c10d_functional.wait_tensor.default", _MEM)
TREE_MAP_ONLY = _private("torch.utils._pytree.tree_map_only", _MEM)
# DTensor's shape propagation, which the trackers must not count (it runs on global-size fake
# tensors); patched for the duration of an estimate with patched() below.
SHARDING_PROPAGATION = _private(
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached", _MEM
)
# A pipeline stage's shape handshake with its neighbours, which on a fake process group rank 0
# answers itself (titanctl.planning.memory.pipeline_peers): the metadata messages, the stage's inferred
# metadata, and the methods that exchange them. This protocol came with torch 2.12 (2.11 infers shapes
# in one older method, under no_grad): estimate-memory of a pipeline layout needs 2.12 or newer.
_PP_PROTOCOL = ">=2.12"
STAGE_FORWARD_META = _private(
    "torch.distributed.pipelining._utils._StageForwardMeta", _MEM, torch_versions=_PP_PROTOCOL
)
STAGE_BACKWARD_META = _private(
    "torch.distributed.pipelining._utils._StageBackwardMeta", _MEM, torch_versions=_PP_PROTOCOL
)
DERIVE_GRAD_METAS = _private(
    "torch.distributed.pipelining._utils._derive_grad_metas", _MEM, torch_versions=_PP_PROTOCOL
)
STAGE_META = _private(
    "torch.distributed.pipelining.stage._PipelineStageBase", _MEM, instance_attr="_stage_meta",
    torch_versions=_PP_PROTOCOL,
)
STAGE_HANDSHAKE = {
    name: _private(f"torch.distributed.pipelining.stage.PipelineStage.{name}", _MEM, torch_versions=_PP_PROTOCOL)
    for name in ("_recv_meta", "_send_meta")
}
# Before that, the first step decides whether shapes are inferred by running the first microbatch
# (dynamic: what a run without static shapes does, and pays for in memory) or known (static); rank 0
# alone on a fake process group must decide "dynamic" like the real run (infer_shapes_on_fake_group
# below). The schedule's set-up that decides: torch 2.13-2.14 by a vote each stage passes on to its
# neighbour, 2.15 by one all-reduce.
PIPELINE_MODE_SET_UP = (
    _private(
        "torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p", _MEM,
        torch_versions=f"{_PP_PROTOCOL},<2.15",
    ),
    _private(
        "torch.distributed.pipelining.schedules._PipelineSchedule._initialize_pipeline_distributed_state", _MEM,
        torch_versions=">=2.15",
    ),
)
# torch 2.14 and 2.15 refuse "dynamic" outright on a fake process group (they cannot know that titanctl
# answers for the missing peers) when this test says a stage needs it: the set-up runs with the test
# answering no, then the mode is set on each stage.
PIPELINE_NEEDS_DYNAMIC = _private(
    "torch.distributed.pipelining._utils.InferenceMode.needs_dynamic", _MEM, torch_versions=_PP_PROTOCOL
)
PIPELINE_DYNAMIC = _private(
    "torch.distributed.pipelining._utils.InferenceMode.DYNAMIC", _MEM, torch_versions=_PP_PROTOCOL
)
STAGE_INFERENCE_MODE = _private(
    "torch.distributed.pipelining.stage.PipelineStage", _MEM, instance_attr="_inference_mode",
    torch_versions=_PP_PROTOCOL,
)
# torch 2.13 votes through the process group and reads the result with .item(), which a fake tensor
# refuses: each stage's vote is answered with "dynamic" here (2.14 skips the vote on a fake group).
PIPELINE_VOTE = {
    name: _private(
        f"torch.distributed.pipelining.stage.PipelineStage.{name}", _MEM, torch_versions=f"{_PP_PROTOCOL},<2.15"
    )
    for name in ("_warmup_forward_vote", "_warmup_backward_result")
}
# A tensor's in-place write counter: what a pipeline stage's shape inference wrote into its buffers is
# undone (titanctl.parallel.layouts.pipeline_parallel), and only that.
TENSOR_VERSION = _private("torch.Tensor._version", "pipeline parallel (buffers through shape inference)")
# The first step's set-up of a stage, which the estimator labels so that its memory is kept apart
# from the schedule's actions (titanctl.planning.memory.pipeline_peers.label_actions): shape inference (a
# forward, then a backward, on the first microbatch), each followed by the buffers for every
# microbatch's messages. PipelineStage calls these private methods itself and offers no hook
# around them.
STAGE_SET_UP = {
    step: _private(f"torch.distributed.pipelining.stage.PipelineStage.{name}", _MEM, torch_versions=_PP_PROTOCOL)
    for step, name in (
        ("forward shapes", "_forward_metadata_inference"),
        ("forward buffers", "_setup_forward_recv_info"),
        ("backward shapes", "_backward_metadata_inference"),
        ("backward buffers", "_setup_backward_recv_info"),
    )
}


def replicated_style() -> Any:
    """A tensor-parallel style for a module that runs whole on every rank, on local inputs equal there (tensor
    parallel without sequence parallel): its parameters become replicated DTensors (beside the split ones in
    one optimizer), its inputs and outputs stay local. torch has no public style for it, and a ParallelStyle
    subclass must implement the private ``_apply``."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class Replicated(ParallelStyle):
        def _apply(self, module, device_mesh):
            def replicate_parameters(name, submodule, mesh):
                for param_name, param in list(submodule.named_parameters(recurse=False)):
                    replicated = distribute_tensor(param, mesh, [Replicate()])
                    submodule.register_parameter(param_name, nn.Parameter(replicated))

            return distribute_module(
                module, device_mesh, replicate_parameters,
                lambda module, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                                   for x in inputs),
                lambda module, output, mesh: output.to_local(),
            )

    return Replicated()


# --- helpers for private methods and attributes of objects ---------------------------------------
def flatten_mesh(mesh: Any, name: str) -> Any:
    return MESH_FLATTEN.of(mesh)(mesh_dim_name=name)


def op_schema(op: Any) -> Any:
    return OP_SCHEMA.of(op)


def dtensor_local_tensor(tensor: Any) -> Any:
    return DTENSOR_LOCAL_TENSOR.of(tensor)


def float8_weight_inner(tensor: Any) -> Any:
    return FLOAT8_WEIGHT_INNER.of(tensor)


def load_schedule_csv(schedule: Any, path: str) -> None:
    PIPELINE_LOAD_CSV.of(schedule)(path, format="compute_only")


def process_group_names() -> dict:
    """{process group: its name}, read afresh; TorchInternalsError if this torch keeps no such table."""
    PROCESS_GROUP_NAMES.check()
    return dict(_lookup(PROCESS_GROUP_NAMES.path))


def enable_inductor_micro_pipeline_tp() -> None:
    INDUCTOR_MICRO_PIPELINE_TP.check()
    config = importlib.import_module("torch._inductor.config")
    config._micro_pipeline_tp = True


def stage_output_metas(stage: Any) -> Any:
    return STAGE_META.of(stage).outputs


def replace_stage_handshake(stage: Any, **methods: Any) -> None:
    """Replace a PipelineStage's handshake methods (names as in STAGE_HANDSHAKE) on this object only."""
    for name, method in methods.items():
        STAGE_HANDSHAKE[name].of(stage)  # it has the method being replaced
        setattr(stage, name, method)


def infer_shapes_on_fake_group(schedule: Any, stages: list) -> None:
    """Make ``schedule``'s first step infer its stages' shapes from the first microbatch (dynamic
    mode), as a real run without static shapes does, although rank 0 runs alone on a fake process
    group, where the neighbours' part of the mode's agreement cannot arrive. Only these objects are
    changed (and, while the set-up runs, InferenceMode.needs_dynamic)."""
    set_up_entry = next(entry for entry in PIPELINE_MODE_SET_UP if entry.applies)
    original = set_up_entry.of(schedule)
    dynamic = PIPELINE_DYNAMIC.get()
    PIPELINE_NEEDS_DYNAMIC.check()
    for stage in stages:
        STAGE_INFERENCE_MODE.of(stage)  # it has the attribute set below

    def set_up(set_up_stages: list, *args: Any, **kwargs: Any) -> None:
        with patched(PIPELINE_NEEDS_DYNAMIC, staticmethod(lambda *_args, **_kwargs: False)):
            original(set_up_stages, *args, **kwargs)
        for stage in set_up_stages:
            stage._inference_mode = dynamic

    setattr(schedule, set_up_entry.path.rsplit(".", 1)[1], set_up)
    if torch_at_least("2.15"):
        return
    torch = importlib.import_module("torch")

    def vote(*_args: Any, **_kwargs: Any) -> Any:
        return torch.tensor([0], dtype=torch.int32)  # 0: dynamic

    for stage in stages:
        for entry in PIPELINE_VOTE.values():
            entry.of(stage)  # it has the method being replaced
            setattr(stage, entry.path.rsplit(".", 1)[1], vote)


def wrap_stage_set_up(stage: Any, wrap: Callable[[str, Any], Any]) -> None:
    """Replace each of a PipelineStage's set-up methods on this object only by ``wrap(step, method)``,
    where ``step`` is its key in STAGE_SET_UP and ``method`` the bound original."""
    for step, entry in STAGE_SET_UP.items():
        setattr(stage, entry.path.rsplit(".", 1)[1], wrap(step, entry.of(stage)))


@contextlib.contextmanager
def patched(entry: Private, replacement: Any) -> Iterator[Any]:
    """Replace the class attribute ``entry`` names for the duration; yields the original."""
    original = entry.get()
    owner_path, attr = entry.path.rsplit(".", 1)
    owner = _lookup(owner_path)
    # What the class itself holds (a classmethod stays a classmethod), or nothing if it inherits it.
    own = vars(owner).get(attr, _NO_VALUE) if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield original
    finally:
        if own is _NO_VALUE:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)


def cpu_matmul_is_fast(dtype: Any) -> bool:
    """False where torch multiplies ``dtype`` (bf16 or fp16) on the CPU with its generic loop."""
    entry = MKLDNN_FP16_SUPPORTED if str(dtype) == "torch.float16" else MKLDNN_BF16_SUPPORTED
    return bool(entry.get()())


def set_inner_steps_since_sync(algorithm: Any, steps: int) -> None:
    """torchft's LocalSGD or DiLoCo: the inner steps it counts since its last sync."""
    entry = DILOCO_LOCAL_STEP if type(algorithm).__name__ == "DiLoCo" else LOCAL_SGD_LOCAL_STEP
    entry.of(algorithm)  # TorchInternalsError naming the feature if this torchft no longer sets it
    setattr(algorithm, entry.instance_attr, steps)


def diloco_fragment_state_fns(manager: Any, fragment: int) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """The (save, load) pair that DiLoCo's fragment ``fragment`` registered with torchft's Manager."""
    key = DILOCO_FRAGMENT_KEY.format(fragment)
    saves, loads = MANAGER_STATE_DICT_FNS.of(manager), MANAGER_LOAD_STATE_DICT_FNS.of(manager)
    if key not in saves or key not in loads:
        raise MANAGER_STATE_DICT_FNS.missing(f"no state registered under {key!r}")
    return saves[key], loads[key]


def diloco_sync_now(algorithm: Any, optimizer: Any) -> None:
    """Run DiLoCo's next fragment sync now, as its optimizer hook does when that sync is due."""
    set_inner_steps_since_sync(algorithm, DILOCO_SYNC_EVERY.of(algorithm) - 1)
    DILOCO_STEP_POST_HOOK.of(algorithm)(optimizer, (), {})
