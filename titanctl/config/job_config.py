"""The job config: one dataclass per section, every field documented.

Key names follow torchtitan's JobConfig where it has the concept. Each field's help
text is in its metadata so that `--help`-style output and docs/config.md come from
one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(
    default: Any,
    help: str,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
    in_dump_folder: bool = False,
) -> Any:
    """A config field with its documentation and the values it accepts.

    ``min``/``max`` are inclusive bounds, ``above``/``below`` exclusive ones. Every float must also
    be finite, and every int fit in 64 bits (the loader checks both). ``in_dump_folder`` marks a
    folder given relative to job.dump_folder: it must name a folder inside it.
    """
    meta = {
        "help": help, "choices": choices, "min": min, "max": max, "above": above, "below": below,
        "in_dump_folder": in_dump_folder,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("float32", "bfloat16", "float16")
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600  # a week: longer is no timeout, and past ~292 years torch's clocks overflow


@dataclass
class Job:
    dump_folder: str = opt(
        "./outputs", "Folder for metrics, TensorBoard events, checkpoints and traces (not empty)."
    )
    description: str = opt("", "Free text describing the run; printed at start.")
    log_ranks: list[int] = opt([0], "Ranks whose console output is shown (others stay quiet).")


# model.name -> its flavors, as titanctl.models.registry declares them (a test keeps the two equal;
# the config layer sits below the models and cannot ask the registry).
MODEL_FLAVORS = {
    "llama3": ("debugmodel", "debugmodel_torchtitan", "8B", "70B", "405B", "1B", "3B"),
    "qwen3": ("debugmodel", "debugmodel_untied", "0.6B", "1.7B", "4B", "8B", "14B", "32B"),
    "qwen3_moe": ("debugmodel", "30B-A3B", "235B-A22B"),
    "deepseek_v3": ("debugmodel", "16B", "671B"),
    "gpt_oss": ("debugmodel", "20b", "120b"),
    "qwen3_5": ("debugmodel", "debugmodel_untied"),
    "qwen3_5_moe": ("debugmodel", "35B-A3B", "397B-A17B"),
    "qwen3_next": ("debugmodel", "80B-A3B"),
    "deepseek_v4": ("debugmodel", "Flash", "Pro"),
}


@dataclass
class Model:
    name: str = opt("llama3", "Model family.", choices=tuple(MODEL_FLAVORS))
    flavor: str = opt(
        "debugmodel",
        "Model size, one of the family's: "
        + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in MODEL_FLAVORS.items()) + ".",
    )
    n_layers: int = opt(
        0, "Override the flavor's number of layers (0 keeps the flavor's; published models have at most 126).",
        min=0, max=1024,
    )
    n_kv_heads: int = opt(
        0,
        "Override the flavor's number of key/value heads (0 keeps the flavor's); must divide its n_heads. "
        "Equal to n_heads is multi-head attention, as torchtitan's debugmodel (16 of 16; titanctl's has 4).",
        min=0,
    )
    norm_type: str = opt(
        "rmsnorm",
        "RMSNorm implementation: rmsnorm (written out in PyTorch ops) or fused_rmsnorm "
        "(torch.nn.functional.rms_norm: on CUDA one fused kernel forward and one backward; on CPU torch "
        "runs the same elementwise ops as rmsnorm, forward and backward). Same weights, same results.",
        choices=("rmsnorm", "fused_rmsnorm"),
    )
    tokenizer_path: str = opt(
        "", "Tokenizer file (Llama 3 tiktoken format); empty means the bundled tokenizer."
    )
    attn_mask_type: str = opt(
        "causal",
        "Training attention mask: causal (a token sees every earlier token of its window) or block_causal "
        "(document masking: a token sees only the earlier tokens of its own document; a document starts at "
        "each BOS token, so the tokenizer needs one). Generation is always causal (a prompt is one "
        "document); estimate-memory models block_causal on --device cpu only.",
        choices=("causal", "block_causal"),
    )
    mtp_layers: int = opt(
        0,
        "Multi-token prediction depths (DeepSeek's; deepseek_v3 and deepseek_v4 only): depth k predicts the "
        "token k + 1 places ahead from the depth before and the embedding of the token k places ahead, through a block "
        "of its own, sharing the embedding and output layer. Its loss (mean over depths) joins the "
        "objective with model.mtp_loss_weight; the logged loss stays the next-token loss (mtp_loss is "
        "logged apart). 0: off. Not with pipeline or context parallel.",
        min=0, max=8,
    )
    mtp_loss_weight: float = opt(
        0.1,
        "Weight of the multi-token prediction loss in the objective (DeepSeek-V3 used 0.3, then 0.1). "
        "No effect without model.mtp_layers.",
        min=0, max=10,
    )
    indexer_loss_coeff: float = opt(
        0.0,
        "Weight of the lightning indexer's KL loss (deepseek_v4's compressed sparse attention layers): KL from "
        "the attention's distribution over the compressed entries (summed over heads) to the indexer's softmax, "
        "summed over CSA layers; it trains the indexer alone (its inputs are detached) and the logged loss "
        "stays the language model's. 0: off (the indexer does not learn). Models with an indexer only.",
        min=0, max=100,
    )
    indexer_warmup_steps: int = opt(
        0,
        "The indexer's dense warm-up: the first N steps attend to every visible compressed entry (no top-k) "
        "and train the indexer alone, every other weight frozen (DeepSeek-V3.2's first stage); then sparse "
        "training of everything. Needs model.indexer_loss_coeff > 0.",
        min=0,
    )


@dataclass
class OptimizerGroup:
    """Parameters that get their own optimizer or settings: an ``[[optimizer.groups]]`` table."""

    params: str = opt("", "A canonical parameter name or a regular expression that must match whole names "
                          "(e.g. 'layers\\.\\d+\\.attention\\.wq\\.weight').")
    optimizer: str = opt("", "Muon or AdamW; empty means the one optimizer.name gives these parameters.",
                         choices=("", "Muon", "AdamW"))
    lr: float | None = opt(None, "Peak learning rate of this group; unset means optimizer.lr.", above=0)
    weight_decay: float | None = opt(None, "Weight decay of this group's parameters (0 exempts them), as "
                                           "optimizer.weight_decay applies it; unset means optimizer.weight_decay.",
                                     min=0, max=1)
    momentum: float | None = opt(None, "Muon momentum; unset means optimizer.muon_momentum.", min=0, below=1)
    beta1: float | None = opt(None, "AdamW beta1; unset means optimizer.beta1.", min=0, below=1)
    beta2: float | None = opt(None, "AdamW beta2; unset means optimizer.beta2.", min=0, below=1)
    eps: float | None = opt(None, "AdamW epsilon; unset means optimizer.eps.", min=0, max=1)


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "Optimizer. Muon orthogonalizes the update of each 2-D hidden weight (Moonlight's recipe); embeddings, "
        "the output layer, norms, biases and routed experts (unless muon_experts) then use AdamW with beta1, "
        "beta2 and eps.",
        choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "Peak learning rate.", above=0)
    beta1: float = opt(0.9, "Adam beta1.", min=0, below=1)
    beta2: float = opt(0.95, "Adam beta2.", min=0, below=1)
    eps: float = opt(1e-8, "Adam epsilon.", min=0, max=1)
    weight_decay: float = opt(
        0.1,
        "Weight decay of every trainable parameter, norm gains, biases, embeddings and routers included (as in "
        "torchtitan; an [[optimizer.groups]] table with weight_decay = 0 exempts some): decoupled "
        "(w -= lr x weight_decay x w) for AdamW and Muon, an L2 term added to the gradient for Adam.",
        min=0,
        max=1,
    )
    implementation: str = opt(
        "fused",
        "Kernel: fused (one kernel, where the device supports it), foreach, or for-loop.",
        choices=("fused", "foreach", "for-loop"),
    )
    muon_momentum: float = opt(0.95, "Muon: Nesterov momentum.", min=0, below=1)
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations per update (published: 5; more add nothing past ~10).",
                             min=1, max=100)
    muon_ns_dtype: str = opt(
        "float32",
        "Muon: dtype of the Newton-Schulz iterations; bfloat16 is the published code's choice (faster on GPUs).",
        choices=("float32", "bfloat16"),
    )
    muon_experts: bool = opt(
        False, "Muon: also orthogonalize routed expert weights, each expert's matrix on its own (else AdamW)."
    )
    groups: list[OptimizerGroup] = opt(
        [],
        "[[optimizer.groups]] tables choosing the optimizer and its settings by canonical parameter name or "
        "regex (params, optimizer, lr, weight_decay, momentum, beta1, beta2, eps). Each parameter belongs to "
        "at most one table; the rest follow optimizer.name.",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from near zero to optimizer.lr.", min=0, max=10**9)
    decay_ratio: float | None = opt(
        None,
        "Fraction of steps spent decaying at the end (WSD: warmup, stable, decay); "
        "unset means decay over all steps after warmup.",
        min=0,
        max=1,
    )
    decay_type: str = opt(
        "linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine")
    )
    lr_min: float = opt(0.0, "Final learning rate as a fraction of optimizer.lr.", min=0, max=1)


@dataclass
class DatasetEntry:
    """One source of a data mixture: a ``[[training.datasets]]`` table of the recipe."""

    name: str = opt(
        "", "A dataset name: bundled, bundled_val, c4, local, hf:<hub id or local folder>, or chat:<file, folder "
        "or hf:id> (chat fine-tuning data, see the sft section)."
    )
    path: str = opt("", "A local json/jsonl/parquet/txt file or folder (instead of name).")
    weight: float = opt(1.0, "Share of the samples drawn from this source, relative to the others.", above=0)
    config: str = opt("", "hf: only: the dataset's configuration (datasets' `name`), e.g. en for allenai/c4.")
    split: str = opt("train", "hf: and chat: folders only: the split to read.")
    text_field: str = opt("text", "hf: only: the column holding the document text.")

    @property
    def label(self) -> str:
        """How logs and metrics name this source."""
        return self.name or self.path


@dataclass
class Training:
    dataset: str = opt(
        "bundled",
        "Dataset: bundled, bundled_val, c4, local (with dataset_path), hf:<hub id or local folder> "
        "(its train split, streamed), or chat:<jsonl/parquet file, folder or hf:id> (conversations for chat "
        "fine-tuning, rendered with the tokenizer's chat template and packed; see the sft section).",
    )
    dataset_path: str = opt("", "A json/jsonl/parquet/txt file or folder; implies dataset=local.")
    datasets: list[DatasetEntry] = opt(
        [],
        "A data mixture, replacing dataset/dataset_path: [[training.datasets]] tables with name or path, "
        "weight, and for hf: datasets config, split, text_field (docs/data.md: Data mixtures). On the command "
        "line: a TOML inline array, e.g. '[{name = \"bundled\", weight = 0.7}, {path = \"code\", weight = 0.3}]'.",
    )
    stream_shards: int = opt(
        0,
        "Virtual shards of each streaming dataset (c4, hf:): global sample i of a stream comes from shard "
        "i mod N, so the data does not depend on the data-parallel degree; a rank reads only its own "
        "shards when the degree divides N. 0: one shard per file of the dataset. Fixed for a run's life.",
        min=0, max=65536,
    )
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per microbatch.", min=1, max=1 << 20)
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all ranks; more than local_batch_size x data-parallel "
        "degree means gradient accumulation. -1: local_batch_size x data-parallel degree, except that a run "
        "resuming its own checkpoint keeps the checkpoint's (a restart on fewer ranks accumulates more).",
        max=1 << 30,
    )
    seq_len: int = opt(2048, "Tokens per sequence (the longest published contexts have 2^20).", min=1, max=1 << 20)
    max_norm: float = opt(1.0, "Gradient clipping max norm (0 disables clipping).", min=0)
    steps: int = opt(10000, "Optimizer steps to train (a run of 10^9 steps would never end).", min=1, max=10**9)
    seed: int = opt(0, "Seed for weight init, data order and dropout-free RNG state.", min=0, below=2**64)
    deterministic: bool = opt(False, "Use deterministic algorithms (slower, bitwise reproducible).")
    mixed_precision_param: str = opt(
        "bfloat16",
        "Compute dtype: FSDP's parameter dtype under FSDP, an autocast dtype otherwise "
        "(float32 turns mixed precision off).",
        choices=DTYPES,
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of FSDP's gradient reduction.", choices=("float32", "bfloat16")
    )
    gc_freq: int = opt(50, "Run Python's garbage collector every N steps.", min=1)
    cpu_linear: str = opt(
        "auto",
        "Kernel of fp32 linear layers on CPU: onednn (oneDNN, AVX-512 wherever the CPU has it), aten "
        "(torch's default, MKL, which on AMD CPUs runs without AVX-512), or auto: onednn where torch runs "
        "AVX-512 kernels, aten on AVX2-only CPUs (where MKL's AVX2 code is the faster). Same math; results "
        "differ only in the last bits. Tensor-parallel (DTensor) weights and bf16/fp16 compute always use "
        "torch's own kernels (oneDNN already, where the CPU has bf16 units).",
        choices=("auto", "onednn", "aten"),
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Replicas (DDP, or HSDP's replicate dimension).", min=1)
    data_parallel_shard_degree: int = opt(
        -1, "FSDP shard degree; -1 takes the ranks left over by the other degrees."
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered parameters after forward: default (yes, except with pipelining), always, never.",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = opt(1, "Tensor parallel degree (with sequence parallel).", min=1)
    disable_loss_parallel: bool = opt(False, "Gather logits before the loss instead of loss parallel.")
    enable_async_tensor_parallel: bool = opt(False, "Overlap TP communication (CUDA + compile only).")
    pipeline_parallel_degree: int = opt(1, "Pipeline stages' rank groups.", min=1)
    pipeline_parallel_split_points: list[str] = opt(
        [], "Module names that start a new stage, e.g. layers.4,layers.8."
    )
    pipeline_parallel_layers_per_stage: int = opt(
        0, "Split into stages of this many layers (0: use split points, or one stage per rank).", min=0
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "Pipeline schedule.",
        choices=(
            "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
            "ZBVZeroBubble", "DualPipeV",
        ),
    )
    pipeline_parallel_schedule_csv: str = opt("", "A schedule CSV file (overrides the schedule name).")
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch.", min=1)
    context_parallel_degree: int = opt(1, "Context parallel degree (sequence sharded across ranks).", min=1)
    context_parallel_method: str = opt(
        "ring",
        "How attention is split over the context parallel ranks: ring (each rank keeps its queries, keys and "
        "values circulate; context_parallel_rotate_method says how), ulysses (two all-to-alls per attention: "
        "each rank attends over the whole sequence for n_heads / (tp x cp) heads) or ulysses_ring (the hybrid: "
        "Ulysses' all-to-alls over context_parallel_ulysses_degree neighbouring ranks, the masked ring over the "
        "cp / that groups for n_heads / (tp x that) heads).",
        choices=("ring", "ulysses", "ulysses_ring"),
    )
    context_parallel_ulysses_degree: int = opt(
        1,
        "Under context_parallel_method = ulysses_ring: the Ulysses ranks of each ring group (neighbouring ranks, "
        "inside a node where it fits). At least 2, smaller than context_parallel_degree and dividing it, and "
        "dividing n_heads / tensor_parallel_degree (and a Gated DeltaNet model's key heads / tensor_parallel_degree); "
        "the ring runs over context_parallel_degree / this. Any other method takes 1.",
        min=1,
    )
    context_parallel_rotate_method: str = opt(
        "allgather", "How ring attention exchanges K/V (context_parallel_method = ring).",
        choices=("allgather", "alltoall"),
    )
    context_parallel_load_balancer: str = opt(
        "mask_aware",
        "Which positions each context parallel rank holds under a mask (block_causal documents, or gpt-oss's "
        "masks by layer type; context_parallel_method = ring): mask_aware (per microbatch, equal chunks dealt "
        "to the ranks by the attention work the mask gives their queries; head-tail unless that beats it) or "
        "head_tail (rank r holds chunks r and 2cp-1-r of 2 x cp). Causal attention without a mask always runs "
        "head-tail (exactly balanced); Ulysses needs no order; Gated DeltaNet families keep head-tail.",
        choices=("head_tail", "mask_aware"),
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert parallel degree (MoE models): the routed experts are split over this many of the "
        "data-parallel-shard x context-parallel ranks, tokens reach them by all-to-all, and FSDP "
        "shards each expert over the rest; must divide dp_shard x cp and the number of experts.",
        min=1,
    )


@dataclass
class Checkpoint:
    enable_checkpoint: bool = opt(False, "Save and resume checkpoints.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.", in_dump_folder=True)
    interval: int = opt(500, "Save every N steps (and at the last step).", min=1)
    keep_latest_k: int = opt(
        10, "Keep the newest k checkpoints (0 keeps all); DCP step folders and Hugging Face saves are "
        "counted apart (the newest k of each).", min=0
    )
    load_step: int = opt(-1, "Step to resume from; -1 takes the newest complete checkpoint.")
    async_mode: str = opt(
        "disabled",
        "Save without blocking training: disabled, async, or async_with_pinned_mem (CUDA).",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    initial_load_path: str = opt(
        "",
        "Checkpoint to start from when the run has none of its own: a titanctl step folder, or a "
        "Hugging Face, torchtitan, Meta or torchtune folder (weights converted on the fly).",
    )
    initial_load_model_weights_only: bool = opt(True, "Take only the model weights from initial_load_path.")
    last_save_model_weights_only: bool = opt(False, "Make the final checkpoint weights only.")
    export_dtype: str = opt(
        "float32", "Dtype of a weights-only final checkpoint and of Hugging Face saves.", choices=DTYPES
    )
    save_format: str = opt(
        "dcp",
        "What a save writes: dcp (step-N, resumable), hf (step-N-hf, a Hugging Face model folder: "
        "weights only, so a run cannot resume from it) or both.",
        choices=("dcp", "hf", "both"),
    )
    last_save_in_hf: bool = opt(
        False,
        "Also write the final step as a Hugging Face model folder (step-N-hf: config.json, safetensors, "
        "tokenizer), gathered tensor by tensor from the sharded model; needs enable_checkpoint.",
    )
    exclude_from_loading: list[str] = opt([], "State to skip when resuming, e.g. optimizer,dataloader.")
    create_seed_checkpoint: bool = opt(False, "Write the initialized weights as step 0 and stop.")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("selective", "Recompute activations in backward.", choices=("none", "full", "selective"))
    selective_ac_option: str = opt(
        "2", "Selective AC: a number N checkpoints every N-th block; 'op' saves a list of ops."
    )


@dataclass
class Compile:
    enable: bool = opt(
        False,
        "torch.compile each transformer block and the final norm, and the loss (except under TP's loss "
        "parallel, whose loss is computed on sharded logits). The first step of a process pays the "
        "compile time; the console and metrics.jsonl show that step apart.",
    )


@dataclass
class Float8:
    enable_float8_linear: bool = opt(
        False,
        "Train linear layers in float8 with torchao (dynamic scales, see recipe_name). Float8 hardware on CUDA "
        "SM 8.9+; emulated elsewhere (CPU included), which tests the path but is slower, not faster.",
    )
    recipe_name: str = opt(
        "tensorwise",
        "torchao's scaling recipe: tensorwise (one scale per tensor; the only one with float8 FSDP all-gathers "
        "and float8 tensor-parallel communication) or rowwise (one scale per row of each operand, power-of-2 "
        "scales: closer to bf16's accuracy, communication in high precision).",
        choices=("tensorwise", "rowwise"),
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "FSDP all-gathers float8 linears' weights in float8 (half of bf16's traffic); needs FSDP."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False,
        "Compute the float8 scales of all FSDP-sharded weights with one all-reduce after the optimizer "
        "step, instead of one per layer in forward; needs enable_fsdp_float8_all_gather.",
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linear layers kept in high precision, by name or dotted part of a name (output, attention.wk, "
        "layers.0). Linears whose dims (per tensor-parallel shard) are not multiples of 16 are kept too.",
    )


@dataclass
class LoRA:
    enable: bool = opt(
        False,
        "Train low-rank adapters (LoRA) on a frozen base model: each targeted linear computes W x + "
        "(alpha / rank) B A x with A (rank x in) and B (out x rank) trained, W frozen; B starts at zero, so "
        "the first step's model is the base. The base comes from checkpoint.initial_load_path (required) "
        "and is recorded (path and fingerprint) in every checkpoint, which holds only the adapters, the "
        "optimizer and the step (docs/post-training.md: LoRA).",
    )
    rank: int = opt(8, "Rank r of every adapter.", min=1, max=65536)
    alpha: float = opt(16.0, "The adapters' scale numerator: their output is multiplied by alpha / rank "
                             "(published recipes use 8 to 512).", above=0, max=10_000)
    dropout: float = opt(
        0.0, "Dropout on the adapters' input while training (the frozen path sees none).", min=0, below=1
    )
    target_modules: list[str] = opt(
        ["attention"],
        "Linear layers that get an adapter, by name or run of dotted parts of a name: attention (every "
        "attention projection), feed_forward, attention.wq, layers.0, output (untied models), moe.experts "
        "(routed experts: per-expert A and B stacks), experts.w2. Each entry must name at least one.",
    )
    target_regex: str = opt(
        "",
        "A Python regular expression that the whole canonical name must match, over the family's linear "
        "layers and routed expert stacks (e.g. layers\\.\\d+\\.attention\\.w[qv] or "
        "layers\\.\\d+\\.moe\\.experts\\.w[13]); when set, it replaces target_modules.",
    )


@dataclass
class MoEBalancing:
    load_balance_coeff: float = opt(
        0.0,
        "Auxiliary-loss-free load balancing (DeepSeek-V3): after every optimizer step, each MoE layer's "
        "expert bias moves by this much toward the experts that received fewer tokens than the mean over "
        "the global batch (b_e += coeff x sign(mean - tokens_e)); the bias changes which experts are chosen, "
        "not their weights. 0 turns it off. "
        "Needs a Mixture-of-Experts model (every MoE family here trains the bias; docs/models.md).",
        min=0, max=1,
    )
    router_aux_loss_coef: float = opt(
        0.0,
        "Weight of the load-balancing auxiliary loss (Qwen3-MoE's router_aux_loss_coef; Switch style: "
        "E x sum_e f_e P_e, f_e the share of routing slots given to expert e, P_e its mean router "
        "probability), computed per sequence and averaged over sequences and MoE layers, so that it is the "
        "same under every layout and microbatching (transformers computes it over a whole batch and all "
        "layers at once: the same for one sequence and one MoE layer). Its gradient is added to the "
        "training loss's; the logged loss stays the cross-entropy. 0 turns it off. Needs a "
        "Mixture-of-Experts model.",
        min=0, max=10,
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps.", min=1)
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder.", in_dump_folder=True)
    enable_wandb: bool = opt(False, "Log to Weights & Biases (WANDB_MODE=offline works without network).")
    peak_tflops: float = opt(
        0.0,
        "Peak device TFLOP/s for MFU; 0 takes the GPU's datasheet figure, or on CPU cores x clock x "
        "FLOPs per cycle of its vector units (nothing is timed).",
        min=0, max=100_000,
    )
    disable_color_printing: bool = opt(False, "Plain console output.")


@dataclass
class Validation:
    enabled: bool = opt(
        False,
        "Evaluate the mean next-token loss and perplexity on held-out data while training "
        "(docs/training.md: Validation).",
    )
    freq: int = opt(100, "Validate every N steps, and at the last step.", min=1)
    steps: int = opt(
        -1,
        "Validation batches per evaluation, each of the training's global batch size; -1 runs the whole "
        "validation set once (all its windows that fill a batch). The same batches every time.",
        min=-1,
    )
    dataset: str = opt(
        "bundled_val",
        "Held-out dataset: bundled_val (the bundled corpus's held-out split), bundled, local (with "
        "dataset_path), or chat:<file, folder or hf:id> (conversations, masked as training masks them); "
        "finite sources only.",
    )
    dataset_path: str = opt("", "A json/jsonl/parquet/txt file or folder; implies dataset=local.")


@dataclass
class SFT:
    train_on: str = opt(
        "assistant",
        "Chat data (training.dataset = chat:...): which tokens the loss learns. assistant: every assistant "
        "turn, its end-of-turn token included (system, user and tool turns and the generation prompt never); "
        "last_assistant: the last assistant turn only; all: every token (docs/post-training.md: Chat data).",
        choices=("assistant", "last_assistant", "all"),
    )
    overlong: str = opt(
        "drop",
        "Chat data: a conversation longer than training.seq_len tokens is dropped (drop) or cut to its "
        "first seq_len tokens (truncate; dropped if nothing to learn is left). Either way it is counted in "
        "the line said at start.",
        choices=("truncate", "drop"),
    )
    chat_template_path: str = opt(
        "",
        "Chat data: a Jinja chat template file to render conversations with, instead of the tokenizer's "
        "own (chat_template.jinja or tokenizer_config.json beside model.tokenizer_path; the bundled "
        "tokenizer has one). A template with {% generation %} marks says itself which text is the "
        "assistant's.",
    )
    validation_split: str = opt(
        "validation",
        "Chat data: the split that validation.dataset = chat:<folder or hf:id> reads (a folder laid out "
        "like a Hugging Face dataset; training reads train, or a mixture entry's split).",
    )


@dataclass
class RL:
    """`titanctl rl`: reinforcement learning with verifiable rewards after SFT (docs/rl.md). Each step
    samples rl.group_size completions of rl.prompts_per_step prompts with the policy itself, scores them,
    and takes rl.updates_per_rollout policy updates (each one of training.steps) on group-relative
    advantages."""

    dataset: str = opt(
        "arithmetic",
        "Prompts with answers: a .jsonl/.jsonl.gz/.json/.parquet file, a folder laid out like a Hugging Face "
        "dataset, hf:<folder or hub id>, or arithmetic (titanctl/assets/arithmetic: which of two two-digit "
        "numbers is larger, built by scripts/build_rl_task.py). Each row has a prompt (text, one user message, "
        "or a list of messages) and an answer; prompts are rendered with the tokenizer's chat template and its "
        "generation prompt.",
    )
    split: str = opt("train", "The split a folder or hf: dataset is read from.")
    prompt_field: str = opt("prompt", "The column holding each row's prompt.")
    answer_field: str = opt("answer", "The column holding each row's answer (text; every row needs one).")
    group_size: int = opt(8, "Completions sampled per prompt (G); advantages are relative to the group.", min=2)
    prompts_per_step: int = opt(
        16, "Prompts per rollout over all data-parallel ranks (each rank samples its share); a multiple of "
        "the data-parallel degree. The policy update's batch is prompts_per_step x group_size sequences, in "
        "microbatches of training.local_batch_size.", min=1,
    )
    max_response_tokens: int = opt(
        16, "Tokens sampled per completion at most (a completion ends earlier at a stop token); the longest "
        "prompt plus this must fit training.seq_len, the model's positions.", min=1,
    )
    temperature: float = opt(1.0, "Sampling temperature; logprobs are those of the tempered distribution.",
                             above=0)
    loss_type: str = opt(
        "grpo",
        "How token losses become the loss (trl 1.16's names): grpo (mean over each completion's tokens, "
        "then over completions), dapo (sum over tokens / the count of response tokens), dr_grpo (sum over "
        "tokens / (completions x max_response_tokens)). Every count is global: over microbatches and "
        "data-parallel ranks.",
        choices=("grpo", "dapo", "dr_grpo"),
    )
    scale_rewards: str = opt(
        "group",
        "Advantage = reward - its group's mean, divided by the group's std (group, GRPO), the std over the "
        "whole rollout (batch), or not divided (none, Dr.GRPO); std is Bessel-corrected, + 1e-4.",
        choices=("group", "batch", "none"),
    )
    importance_sampling_level: str = opt(
        "token",
        "The ratio pi / pi_old of the clipped surrogate: per token, or per completion (sequence: GSPO, the "
        "exp of the mean log-ratio over its tokens, the same for each of its tokens).",
        choices=("token", "sequence"),
    )
    epsilon: float = opt(0.2, "Clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high].", min=0)
    epsilon_high: float | None = opt(
        None, "Upper clipping bound (DAPO's clip-higher, e.g. 0.28); unset: rl.epsilon.", min=0,
    )
    kl_coef: float = opt(
        0.0,
        "Weight of the KL penalty to a frozen reference model, the policy at the run's start (k3 estimator "
        "per token: exp(ref - logp) - (ref - logp) - 1). 0: no reference model is kept. With LoRA the "
        "reference is the base, the adapters switched off.",
        min=0,
    )
    updates_per_rollout: int = opt(
        1, "Policy updates (optimizer steps, each counted in training.steps) on each rollout's batch; the "
        "first one's logprobs are pi_old for the others.", min=1,
    )
    dynamic_sampling: bool = opt(
        False, "DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are left out "
        "of the loss and its counts; the share kept is logged (groups_kept).",
    )
    overlong_buffer_tokens: int = opt(
        0,
        "DAPO's soft overlong punishment: a completion longer than max_response_tokens minus this many tokens "
        "loses up to rl.overlong_penalty of reward, linearly, reaching it at max_response_tokens. 0: off.",
        min=0,
    )
    overlong_penalty: float = opt(1.0, "The largest overlong punishment (rl.overlong_buffer_tokens).", min=0)
    importance_correction: str = opt(
        "none",
        "Correct for the sampler's logprobs differing from the trainer's (without rl.batch_invariant they "
        "differ by rounding): each token's loss is weighted by exp(trainer - sampler logprob), per token or "
        "per completion (its sum), truncated at rl.importance_cap (TIS: *_truncate) or zeroed above it (MIS: "
        "*_mask).",
        choices=("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    )
    importance_cap: float = opt(2.0, "The cap of rl.importance_correction.", above=0)
    batch_invariant: bool = opt(
        False,
        "Exact on-policy numerics: the sampler and the trainer run kernels whose result for a row never "
        "depends on the other rows (linears in fixed tiles of rows, attention over the KV cache's length in "
        "the same order, rsqrt and silu path-independent), so each sampled token's logprob under the logits "
        "it was drawn from equals the trainer's bitwise (logprob_diff_max = 0). Eager only (compile.enable "
        "and rl.compile_sampler must be off); dense and MoE families with grouped-query attention.",
    )
    routing_replay: bool = opt(
        False,
        "MoE: the training forward routes each token to the experts the sampler chose for it (top-k ids "
        "recorded during the rollout), with the weights recomputed from the live router. Needs an MoE model.",
    )
    compile_sampler: bool = opt(
        False, "torch.compile the sampler's decode step (one token of every completion and its choice); not "
        "with rl.batch_invariant.",
    )
    rewards: list[str] = opt(
        ["exact_match"],
        "Reward functions, summed (weighted by rl.reward_weights): exact_match (the response, stripped, is the "
        "answer), math (its final number or last \\boxed{} equals the answer as a number), format (the "
        "response matches rl.format_regex), or module:function, your own code, imported like a recipe's: "
        "function(prompt=str, response=str, answer=str) -> float.",
    )
    reward_weights: list[float] = opt([], "One weight per reward function; empty: 1 each.")
    format_regex: str = opt("", "The regular expression the whole response must match (the format reward).")
    pass_threshold: float = opt(1.0, "A completion passes (pass_rate) when its reward is at least this.")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Capture torch.profiler traces while training.")
    save_traces_folder: str = opt(
        "profile_trace", "Trace folder, relative to job.dump_folder.", in_dump_folder=True
    )
    profile_freq: int = opt(10, "Capture a trace every N steps.", min=1)
    enable_memory_snapshot: bool = opt(False, "Dump CUDA memory snapshots.")
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Snapshot folder, relative to job.dump_folder.", in_dump_folder=True
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout of the first collectives.", min=1, max=MAX_TIMEOUT_SECONDS)
    train_timeout_seconds: int = opt(100, "Timeout of collectives after the first step.", min=1,
                                     max=MAX_TIMEOUT_SECONDS)
    trace_buf_size: int = opt(20000, "Flight Recorder entries kept per rank (0 disables it).", min=0, max=1_000_000)


@dataclass
class FaultTolerance:
    """torchft replica groups: each group is a torchrun world of its own; the groups average gradients
    (or, semi-synchronously, weights) through torchft's Manager, and a lost group rejoins by copying a
    live peer's state instead of restarting the job (docs/fault-tolerance.md)."""

    enable: bool = opt(False, "Train as one replica group of a torchft job (needs the ft extra and a Lighthouse).")
    replica_id: int = opt(0, "This replica group's id, 0..group_size-1 (its data shard, its dump folder's).", min=0)
    group_size: int = opt(1, "Replica groups of the job when all are live: the data is split over this many.", min=1)
    min_replica_size: int = opt(
        1, "Live groups needed to commit a step; with fewer, every group waits for the quorum.", min=1
    )
    process_group: str = opt(
        "gloo", "Backend between the replica groups: gloo (CPU tensors), nccl (CUDA).", choices=("gloo", "nccl")
    )
    lighthouse_address: str = opt(
        "", "The Lighthouse, e.g. http://host:29510; empty: the TORCHFT_LIGHTHOUSE environment variable."
    )
    connect_timeout_seconds: float = opt(
        10.0, "Connecting to the Lighthouse and the group managers; below process_group_timeout_seconds.", above=0,
        max=MAX_TIMEOUT_SECONDS,
    )
    process_group_timeout_seconds: float = opt(
        20.0, "One collective between the replica groups before it is aborted; below timeout_seconds.", above=0,
        max=MAX_TIMEOUT_SECONDS,
    )
    timeout_seconds: float = opt(
        30.0, "The Manager's operations (should_commit, a peer's checkpoint transfer); below quorum_timeout_seconds.",
        above=0, max=MAX_TIMEOUT_SECONDS,
    )
    quorum_timeout_seconds: float = opt(
        60.0, "Waiting for a quorum of live groups; below comm.train_timeout_seconds (the hang watchdog).", above=0,
        max=MAX_TIMEOUT_SECONDS,
    )
    semi_sync_method: str = opt(
        "none",
        "none: average gradients every step; local_sgd: average weights every sync_steps; diloco: an outer "
        "optimizer steps on the averaged pseudo-gradient every sync_steps.",
        choices=("none", "local_sgd", "diloco"),
    )
    sync_steps: int = opt(20, "Inner steps between two syncs (local_sgd, diloco).", min=1)
    fragments: int = opt(
        1, "diloco: model fragments (consecutive layer ranges) synced in turn, one every sync_steps/fragments.", min=1
    )
    outer_lr: float = opt(0.7, "diloco: the outer SGD's learning rate (DiLoCo's: 0.7).", above=0, max=10)
    outer_momentum: float = opt(0.9, "diloco: the outer SGD's momentum.", min=0, below=1)
    outer_nesterov: bool = opt(True, "diloco: Nesterov momentum in the outer SGD.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: LoRA = field(default_factory=LoRA)
    moe: MoEBalancing = field(default_factory=MoEBalancing)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    sft: SFT = field(default_factory=SFT)
    rl: RL = field(default_factory=RL)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
