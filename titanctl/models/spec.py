"""What a model family tells the rest of titanctl: one ``ModelSpec`` per family.

Everything outside ``titanctl/models/`` reaches a family through its spec (from
``titanctl.models.registry``), never by importing the family's folder, so a new family is a
folder and a spec: the trainer, the parallel layouts, checkpoint formats and the tools need no
edit. The fields are data or small functions of the family's ``ModelArgs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from titanctl.models.common.args import ModelArgs


@dataclass(frozen=True)
class HFFormat:
    """The family in Hugging Face's format (a ``*ForCausalLM`` folder of safetensors + config.json).

    Names map titanctl's weight names to Hugging Face's: ``layer_names`` by the suffix after
    ``layers.{i}.`` (model.layers.{i}. on the HF side), ``top_names`` whole. ``config_from_args``
    writes config.json's family-specific keys (the caller adds dtype and token ids);
    ``args_from_config`` reads them back, raising ``CheckpointError`` on a value the family
    cannot build (the caller then checks the args as a whole).
    """

    model_type: str
    architecture: str
    layer_names: Mapping[str, str]
    top_names: Mapping[str, str]
    config_from_args: Callable[[ModelArgs, int | None], dict[str, Any]]
    args_from_config: Callable[[dict[str, Any], int | None, str], ModelArgs]
    # Packed tensors: {titanctl layer suffix: (HF layer suffix, dim, index, parts)}: the titanctl
    # weight is slice `index` of `parts` equal slices of the HF tensor along `dim` (transformers 5's
    # in-memory experts.gate_up_proj holds w1 then w3). Read only.
    packed: Mapping[str, tuple[str, int, int, int]] = field(default_factory=dict)
    # One tensor per expert, the Hub's layout: {titanctl layer suffix: HF layer suffix with {e}}; the
    # titanctl weight stacks them on dim 0. A tuple of suffixes: each expert's matrix is their tensors
    # concatenated along its dim 0 (DeepSeek-V4's w1 then w3 make gate_up_proj). Read and written.
    per_expert: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    # titanctl layer suffixes of state the format does not store (read as zeros, not written).
    not_stored: tuple[str, ...] = ()
    # titanctl layer suffixes whose Hugging Face tensor holds the last two dimensions swapped (gpt-oss's
    # experts: gate_up_proj (E, dim, 2 x hidden) for titanctl's w13 (E, 2 x hidden, dim)). Read and written.
    transposed: tuple[str, ...] = ()
    # titanctl layer suffixes whose rows (dim 0: a weight's, a LoRA B factor's, a conv's channels) titanctl
    # orders otherwise than Hugging Face: {suffix: (to_hf(rows, args), from_hf(rows, args))}, each the
    # other's inverse and shape-preserving (Qwen3.5's Gated DeltaNet groups wqkv per key head). Read and written.
    reordered_rows: Mapping[str, tuple[Callable[[Any, ModelArgs], Any], Callable[[Any, ModelArgs], Any]]] = field(
        default_factory=dict)
    # Multi-token prediction (DeepSeek-V3): {suffix after mtp.{k}.: HF suffix after model.layers.{n_layers + k}.}
    # (the depth's block is layers.{n_layers + k}, named as any layer), and the HF suffixes of that layer
    # that copy the main model's shared weights (the embedding, the output layer): skipped when read.
    mtp_names: Mapping[str, str] = field(default_factory=dict)
    mtp_shared: tuple[str, ...] = ()
    # (bos, eos) ids the family's convention derives from the vocabulary size, for a config.json
    # written without a tokenizer; None for a family whose ids only its tokenizer knows.
    special_ids: Callable[[int], tuple[int | None, int | None]] = lambda vocab_size: (None, None)
    # A published folder that names the decoder without save_pretrained's ``model.`` prefix (DeepSeek-V4's:
    # ``layers.{i}.*``): {save_pretrained's top-level name: the folder's} (``embed.weight``); the layers' names
    # lose the prefix. Empty: the family has no such folder. Read, and written back to such a folder's exports.
    unprefixed_names: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TorchtitanNames:
    """The family in torchtitan 0.3's checkpoints: its model state dict's names where they are not
    titanctl's (``titanctl.models.common.torchtitan_names`` has the shared pieces). A name in none of
    these is the same in both, with the same shape.

    ``layer_names`` by the suffix after ``layers.{i}.``, ``top_names`` whole. ``mtp_names``: the suffix
    after titanctl's ``mtp.{k}.`` -> after torchtitan's ``mtp_layers.{k}.``, which also holds the
    depth's block (titanctl's ``layers.{n_layers + k}``), named as any layer's.
    """

    layer_names: Mapping[str, str]
    top_names: Mapping[str, str]
    mtp_names: Mapping[str, str] = field(default_factory=dict)


def no_extra(model: nn.Module) -> dict:
    """A plan with nothing outside the root and the blocks (no prediction depths of its own to place)."""
    return {}


def _embedding_feeds_blocks(model: nn.Module) -> list[str]:
    return ["tok_embeddings"]


@dataclass(frozen=True)
class TPPlan:
    """The tensor-parallel plan as data: module name -> parallel style, for the model's root
    modules (``root(loss_parallel)``) and for one block (``block(args, float8_styles,
    float8_linears)``, names inside the block). Inference TP derives its shards from the same two.

    Beyond the styles, names inside a block: ``replicated`` modules run whole on every rank (their
    parameters replicated, inputs and outputs local); a ``summed_gradient`` module's first input, equal
    on every rank, feeds only that rank's heads, so its gradient is summed over the ranks; a
    ``head_params`` parameter holds one value per query head and is split with them (dim 0); a
    ``replicated_params`` parameter is whole on every rank (a replicated DTensor beside the split ones), read by
    its module through the style on that module or as this rank's tensor (``to_local``).
    ``extra(model)``: the styles of modules outside the root and the blocks, by their name in the model;
    ``block_inputs(model)``: the modules whose local output a block takes (copied under compile).
    ``sequence_parallel_optional``: ``root`` and ``block`` also take ``sequence_parallel=False``, a plan
    whose activations stay whole on every rank between blocks (what a decode step of one token needs).
    ``split_sizes(args)``: (what, size) of each count the plan splits, which the degree must divide; None: the
    shared decoder's (query and key-value heads, the FFN's hidden units, Gated DeltaNet's key heads).
    """

    root: Callable[[bool], dict]
    block: Callable[..., dict]
    replicated: tuple[str, ...] = ()
    summed_gradient: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()
    replicated_params: tuple[str, ...] = ()
    extra: Callable[[nn.Module], dict] = no_extra
    block_inputs: Callable[[nn.Module], list[str]] = _embedding_feeds_blocks
    sequence_parallel_optional: bool = False
    split_sizes: Callable[[ModelArgs], list[tuple[str, int]]] | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str  # config model.name
    flavors: Mapping[str, ModelArgs]  # published dimensions per size, plus a CPU-sized debugmodel
    build: Callable[[ModelArgs], nn.Module]  # the parallelism-agnostic module, on the current device
    tp_plan: TPPlan
    # A copy of a (meta-device) model holding only some layers, with the embedding on the first stage
    # and the output head on the last: (model, layer_ids, is_first, is_last) -> stage.
    split_stage: Callable[[nn.Module, Iterable[int], bool, bool], nn.Module]
    # Training FLOPs per token of the whole model at a sequence length (active parameters for MoE).
    flops_per_token: Callable[[ModelArgs, int], float]
    hf: HFFormat
    # Checkpoint formats beyond DCP and Hugging Face that the family exists in (meta, torchtune,
    # torchtitan): `convert` refuses the others for this family.
    formats: tuple[str, ...] = ()
    # torchtitan 0.3's names of the family's weights (a family with "torchtitan" in formats has them).
    torchtitan: TorchtitanNames | None = None
    # torchtune's names, (per-layer suffixes, top-level names): titanctl -> torchtune, for the family
    # whose torchtune builders titanctl writes for (one family: torchtune's format has no family field).
    torchtune_names: tuple[Mapping[str, str], Mapping[str, str]] | None = None
    # Where `download-tokenizer` fetches the family's tokenizer: (Hub repository, folder in it).
    tokenizer_repo: tuple[str, str] = ("", "")
    # Refuses (ConfigError, one line) a recipe's args the family cannot run, its max_seq_len the run's
    # sequence length: what ``build`` cannot check, as it also builds at max_seq_len 1 to count weights.
    check_run: Callable[[ModelArgs], None] = lambda args: None
    # Parallel dimensions (``ParallelDims`` fields: "tp", "pp", "cp", "ep", "dp_shard", "dp_replicate") the
    # family does not run under yet, each with why: a layout with one of them > 1 is refused in one line.
    layouts_not_built: Mapping[str, str] = field(default_factory=dict)
    # The MoE balancing keys (``moe.load_balance_coeff``, ``moe.router_aux_loss_coef``) the family's MoE
    # layers do not train by, each with why: set above 0, they are refused in one line.
    moe_keys_not_built: Mapping[str, str] = field(default_factory=dict)
    # Some parameters may get no gradient in a step (a part trained by a loss of its own that may be off):
    # DDP then finds them each step (``find_unused_parameters``) and leaves their gradients None, as one
    # process does, where otherwise it would wait for them forever and fail the next step.
    parameters_may_go_unused: bool = False
    # Elements per query token of the attention scores layer ``layer`` materializes at ``args.max_seq_len``
    # (heads x keys it scores), for a family whose attention is no fused kernel: (args, layer, cp) -> count, on
    # a rank of context parallel degree cp (1: one process). The planner's memory model counts them
    # (titanctl/planning/plan/memory_model.py); 0: a fused kernel.
    attention_scores: Callable[..., int] = lambda args, layer, cp=1: 0
    # Refuses (ParallelError, one line) a context-parallel layout the family's attention cannot run, before any
    # rank connects: (args, training.seq_len, context_parallel_degree, context_parallel_method) -> None.
    check_context_parallel: Callable[[ModelArgs, int, int, str], None] = lambda args, seq_len, cp, method: None
