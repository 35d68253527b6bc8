"""The attention mask of each training microbatch (``model.attn_mask_type``).

``causal`` hands the model no mask: its fast causal path runs unchanged. ``block_causal`` builds
a document mask once per microbatch from the whole (unsharded) input tokens (a document starts at
each BOS), or, for chat data, from the positions the loader packed with them (a conversation starts
where its positions restart at 0; no token id marks it), before pipeline or
context-parallel sharding: the pipeline splits it along the batch with the inputs and passes it to
every stage, and under (ring) context parallelism it is the mask of this rank's queries over all keys, kept as
what defines it (a ``RingMask``: the documents' starts and the ranks' order, O(T) per rank; the masked ring makes
each block from it as it goes). The model hands the one mask to every attention layer. Its form: a
``SpanMask`` (the documents' starts, O(T); ``span_attention`` attends each chunk of queries to the keys its rows
see) on CPU and wherever sinks or windows take part, a FlexAttention BlockMask on other devices.

gpt-oss (attention sinks, sliding-window layers) attends under explicit masks only: without context
parallelism each sliding layer narrows the mask it gets (or the causal one) to its window itself; under
context parallelism the step builds the masks of this rank's queries over all keys here, one per layer
type ({"full_attention": ..., "sliding_attention": ...}, ``RingMask``s), causal ones too, so that every layer
runs the masked ring (``masked_ring``; torch's ring attention takes neither a window nor a sink).

Under Ulysses context parallelism (``parallelism.context_parallel_method = "ulysses"``) every kernel sees
the whole sequence in order, for a share of the heads: the masks are the one-process ones, built by
layer type over all positions (``SpanMask``s, on every device) when the model has sliding layers (its layers
hold T / cp tokens and could not narrow them), and nothing gathers keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanctl import _torch_compat
from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError
from titanctl.models.common.document_mask import build_document_mask, document_ids, mask_form_for
from titanctl.models.common.span_mask import SpanMask
from titanctl.parallel.layouts.context_parallel import (
    document_cp_positions,
    enable_document_context_parallel,
    load_balanced_order,
)
from titanctl.parallel.layouts.cp_balance import attention_work, mask_aware_order, rank_work
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.ring_mask import RingMask, document_start_positions
from titanctl.parallel.layouts.sequence_pieces import holds_sequence_pieces


def shapes_only(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is estimate-memory's fake one (shapes, no values): no order can be read off it, and
    every order gives the same shapes."""
    return isinstance(tensor, _torch_compat.FAKE_TENSOR.get())


def needs_layer_masks(args) -> bool:
    """Whether the model's attention cannot run as torch's ring attention under context parallelism:
    sinks in its softmax, or sliding-window layers (gpt-oss)."""
    return args.attention_sinks or "sliding_attention" in args.layer_types


@dataclass
class MicrobatchMasks:
    bos_id: int | None  # None: causal, no mask (unless positions are given)
    cp_mesh: object | None = None  # the CP mesh when cp > 1 (block_causal, or masks by layer type)
    by_positions: bool = False  # chat data: documents start where positions restart
    window: int | None = None  # masks by layer type under CP (gpt-oss): the sliding layers' window (0: none)
    spans: bool = False  # SpanMasks on every device (sinks and sliding windows: no BlockMask kernel takes them)
    ulysses: bool = False  # Ulysses CP: every kernel sees the whole sequence, so masks are over all positions
    cp: int = 1  # the context parallel degree
    balancer: str = "head_tail"  # parallelism.context_parallel_load_balancer (Gated DeltaNet: head_tail)
    windows: tuple[int | None, ...] = (None,)  # per softmax-attention layer: its sliding window, None full
    # ulysses_ring: the Ulysses ranks of a ring group, which attend the group's queries head by head. Orders are
    # chosen over the cp / u groups (their members' share of the work is the group's / u whatever positions each
    # holds), so a group's positions are sorted: its masked-ring blocks stay narrow (for a causal mask, the own
    # block is the causal triangle), and the Gated DeltaNet scan gets head-tail's chunks i and 2r-1-i a group.
    cp_ulysses: int = 1

    @classmethod
    def build(
        cls, cfg: JobConfig, dims: ParallelDims, bos_id: int | None, model_parts: list[torch.nn.Module],
        by_positions: bool = False,
    ) -> MicrobatchMasks:
        """Check the setting against the tokenizer and prepare the layout (ring CP: the masked ring)."""
        args = model_parts[0].args if model_parts else None
        # Layers that read their neighbours through sequence_pieces (DeepSeek-V4's) take no mask under CP either.
        own_pieces = dims.cp > 1 and any(holds_sequence_pieces(part) for part in model_parts)
        # ulysses_ring: every kernel runs the masked ring over the ring groups, causal ones too (ulysses_ring.py)
        hybrid = dims.cp > 1 and dims.cp_ulysses > 1
        layered = args is not None and needs_layer_masks(args) and not own_pieces
        window = args.sliding_window if dims.cp > 1 and layered else None
        if hybrid and window is None:  # masks by layer type, the causal one too (no sliding layers: window 0)
            layered, window = True, 0
        causal = cfg.model.attn_mask_type == "causal"
        balance = {"cp": dims.cp, "windows": layer_windows(args)}
        # The Gated DeltaNet scan (linear_attention_cp.py) passes state between head-tail's two chunks a rank.
        scan = args is not None and "linear_attention" in args.layer_types
        balance["balancer"] = "head_tail" if scan else cfg.parallelism.context_parallel_load_balancer
        if causal and window is None:
            return cls(bos_id=None, **balance)
        if not causal and bos_id is None and not by_positions:
            where = cfg.model.tokenizer_path or "the bundled tokenizer"
            raise ConfigError(
                f"model.attn_mask_type = {cfg.model.attn_mask_type} finds documents by their BOS token, but "
                f"{where} has none; use model.attn_mask_type = causal"
            )
        ulysses = dims.cp > 1 and cfg.parallelism.context_parallel_method == "ulysses"
        cp_mesh = None
        if hybrid:  # the masks of each ring group's queries (its Ulysses ranks' positions) over all keys
            cp_mesh = dims.mesh["cp_ring"]
        elif dims.cp > 1 and not ulysses:
            cp_mesh = dims.mesh["cp"]
            for part in model_parts:
                enable_document_context_parallel(part, cp_mesh)
        return cls(bos_id=None if causal else bos_id, cp_mesh=cp_mesh, by_positions=by_positions and not causal,
                   window=window, spans=layered, ulysses=ulysses, cp_ulysses=dims.cp_ulysses if hybrid else 1,
                   **balance)

    def cp_order(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every position of the microbatch in the order the CP ranks hold them, when this rank keeps its
        queries and gathers all keys (a mask under ring CP): chosen by ``balancer``. None otherwise (no CP,
        Ulysses, or causal attention, which torch's ring orders head-tail itself)."""
        if self.cp_mesh is None or (self.window is None and self.bos_id is None and not self.by_positions):
            return None
        groups = self.cp // self.cp_ulysses
        if self.balancer == "head_tail" or shapes_only(inputs):
            return load_balanced_order(inputs.shape[1], groups)
        return mask_aware_order(self.work(inputs, positions), groups)

    def work(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) the keys each query position attends under the microbatch's masks, summed over its rows and
        the softmax-attention layers (cp_balance.attention_work)."""
        doc_ids = None
        if positions is not None and (self.by_positions or self.window is not None):
            doc_ids = (positions == 0).cumsum(dim=1)
        elif positions is None and self.bos_id is not None:
            doc_ids = document_ids(inputs, self.bos_id)
        return attention_work(doc_ids, inputs.shape[1], list(self.windows))

    def rank_work(self, inputs: torch.Tensor, positions: torch.Tensor | None, order: torch.Tensor | None):
        """(cp,) each CP rank's attention work for the microbatch: under Ulysses every rank attends every
        position for 1/cp of the heads; else the ranks hold ``order`` (None: head-tail)."""
        work = self.work(inputs, positions)
        if self.ulysses:
            return work.sum().expand(self.cp) / self.cp
        if self.cp_ulysses > 1:  # a ring group's work, shared by its Ulysses ranks head by head
            order = load_balanced_order(inputs.shape[1], self.cp // self.cp_ulysses) if order is None else order
            groups = rank_work(work, order, self.cp // self.cp_ulysses)
            return (groups / self.cp_ulysses).repeat_interleave(self.cp_ulysses)
        return rank_work(work, load_balanced_order(inputs.shape[1], self.cp) if order is None else order, self.cp)

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor | None = None,
                 order: torch.Tensor | None = None):
        """The mask for the model's ``attn_mask`` of a microbatch of whole windows (B, T); None: causal.
        ``positions`` (B, T): each token's position in its document (chat data). ``order``: ``cp_order``'s."""
        if self.window is not None:
            return self._by_layer_type(inputs, positions, order)
        if self.bos_id is None and not self.by_positions:
            return None
        if self.cp_mesh is not None:
            return self._ring_mask(inputs, positions, order)
        # span (documents' starts) wherever the kernels cannot take a BlockMask: CPU, and sinks or windows
        form = "span" if self.spans else mask_form_for(inputs.device)
        doc_ids = self._document_ids(inputs, positions)
        return None if doc_ids is None else build_document_mask(doc_ids, form)

    def _document_ids(self, inputs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T): each token's document (None: one document per window: causal, or text without BOS among chat
        data)."""
        if positions is not None:
            return (positions == 0).cumsum(dim=1)  # a new document at each position 0
        return None if self.bos_id is None else document_ids(inputs, self.bos_id)

    def _ring_mask(self, inputs: torch.Tensor, positions: torch.Tensor | None, order: torch.Tensor | None) -> RingMask:
        """This ring CP rank's queries over all keys (``order``'s) under the microbatch's documents (causal: one
        document)."""
        q_positions, kv_positions = document_cp_positions(inputs.shape[1], self.cp_mesh, order)
        starts = document_start_positions(self._document_ids(inputs, positions), inputs.shape[1], inputs.device)
        return RingMask(starts, q_positions, kv_positions, self.cp_mesh.size())

    def _by_layer_type(self, inputs: torch.Tensor, positions: torch.Tensor | None,
                       order: torch.Tensor | None) -> dict[str, SpanMask | RingMask]:
        """Masks of this CP rank's queries (Ulysses: SpanMasks of all queries) over all keys: the document (or
        causal) one for full layers, narrowed to the last ``window`` positions for sliding ones."""
        # (ulysses_ring runs models without sliding layers here too: window 0, no sliding mask)
        if not self.ulysses:  # ring CP (ulysses_ring: over the ring groups), both from one set of document starts
            full = self._ring_mask(inputs, positions, order)
            masks = {"full_attention": full}
            if self.window:
                masks["sliding_attention"] = RingMask(full.starts, full.q_positions, full.kv_positions, full.cp,
                                                      self.window)
            return masks
        # Ulysses: the kernels' whole sequence, in order (a layer of T / cp tokens cannot narrow it); the starts
        # one row per microbatch row, so that a pipeline splits them with the inputs
        starts = document_start_positions(self._document_ids(inputs, positions), inputs.shape[1], inputs.device)
        full = SpanMask(starts.expand(inputs.shape[0], -1))
        return {"full_attention": full, "sliding_attention": full.narrowed(self.window)}


def layer_windows(args) -> tuple[int | None, ...]:
    """Per softmax-attention layer of the model: its sliding window, None for full attention (Gated DeltaNet
    layers cost the same per token wherever it sits: they do not count)."""
    if args is None:
        return (None,)
    windows = tuple(args.sliding_window if args.is_sliding_layer(i) else None
                    for i in range(args.n_layers) if not args.is_linear_attention_layer(i))
    return windows or (None,)
