"""The decoder-only transformer every family builds, written once and sharded from outside.

Nothing here knows about parallelism. Projections reshape with ``-1`` heads, so a
tensor-parallel plan that shards them column-wise just works; ``layers`` is a
ModuleDict keyed by layer id, so pipeline stages keep canonical names; and any of
``tok_embeddings``, ``norm``, ``output`` may be set to None by a pipeline split.

A family says what its blocks are made of where families differ (``Blocks``: each block's
attention, an MoE block's routed experts, a prediction depth), and its spec builds
``Transformer(args, blocks)``; the rest (norms, the dense SwiGLU, the router, the loop) is shared.

Inference adds an optional static KV cache (``setup_kv_cache``, then ``forward(tokens, input_pos)``
with a tensor of positions); training never passes ``input_pos`` and runs exactly the cache-free code.

With ``tie_embeddings`` the output layer's weight *is* the embedding table (one Parameter, two
state-dict keys: ``tok_embeddings.weight`` and ``output.weight``).

Multi-token prediction (``args.mtp_layers`` depths): depth k's block is ``layers.{n_layers + k - 1}``,
kept in ``layers`` so that every layout shards, checkpoints and balances it as any block (the main
forward stops at ``n_layers``), and the family's depth module (``Blocks.prediction_depth``) is
``mtp.{k - 1}``: it turns the hidden states of the depth before and the embeddings of the tokens
ahead into the block's input (``forward(h, ahead)``), and the block's output into the depth's hidden
state (``norm``). Depths share the embedding and the output layer with the main model.
``forward(..., mtp=True)`` also returns each depth's logits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanctl.models.common.args import ModelArgs, MoEArgs
from titanctl.models.common.attention import Attention
from titanctl.models.common.feed_forward import FeedForward
from titanctl.models.common.init import ParamInit
from titanctl.models.common.moe import MoE, grouped_experts
from titanctl.models.common.norms import RMSNorm, build_norm
from titanctl.models.common.rope import rope_table


def grouped_query_attention(args: ModelArgs, layer_id: int) -> nn.Module:
    """The shared attention; args that ask for another kind are refused (their family's Blocks build it)."""
    for asked, what in ((args.mla is not None, "latent attention (mla)"), (args.attention_sinks, "attention sinks")):
        if asked:
            raise ValueError(f"ModelArgs of family {args.family!r} ask for {what}, which its blocks do not build")
    return Attention(args, layer_id)


@dataclass(frozen=True)
class Blocks:
    """The parts of a family's decoder where families differ, each built from the model's args:
    a block's attention (``attention(args, layer_id)``, with ``Attention.forward``'s signature), an MoE
    block's routed experts (``experts(dim, moe)``, with ``GroupedExperts.forward``'s), and one
    multi-token-prediction depth (``prediction_depth(args)``; None: the family has none)."""

    attention: Callable[[ModelArgs, int], nn.Module] = grouped_query_attention
    experts: Callable[[int, MoEArgs], nn.Module] = grouped_experts
    prediction_depth: Callable[[ModelArgs], nn.Module] | None = None

    def build(self, args: ModelArgs) -> Transformer:
        """The decoder of ``args`` made of these parts (a family's ``ModelSpec.build``)."""
        return Transformer(args, self)


SHARED = Blocks()


class TransformerBlock(nn.Module):
    """Attention, then a dense SwiGLU (``feed_forward``) or a Mixture of Experts (``moe``)."""

    def __init__(self, args: ModelArgs, layer_id: int = 0, blocks: Blocks = SHARED):
        super().__init__()
        self.attention = blocks.attention(args, layer_id)
        moe = args.is_moe_layer(layer_id)
        self.feed_forward = None if moe else FeedForward(args.dim, args.ffn_hidden_dim)
        self.moe = MoE(args.dim, args.moe, blocks.experts(args.dim, args.moe)) if moe else None
        self.attention_norm = build_norm(args)
        self.ffn_norm = build_norm(args)
        # The std divisor of this block's output projections (its modules' param_inits): its depth.
        self.init_depth = layer_id + 1 if args.depth_init else args.n_layers

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, input_pos=input_pos, attn_mask=attn_mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, blocks: Blocks = SHARED):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (from the tokenizer)")
        if args.mtp_layers and blocks.prediction_depth is None:
            raise ValueError(f"ModelArgs.mtp_layers = {args.mtp_layers}: family {args.family!r} has no prediction "
                             "depths")
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        n_blocks = args.n_layers + args.mtp_layers  # the prediction depths' blocks after the main ones
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i, blocks) for i in range(n_blocks)})
        self.mtp = nn.ModuleDict({str(k): blocks.prediction_depth(args) for k in range(args.mtp_layers)}) or None
        self.norm: RMSNorm | None = build_norm(args)
        # Tied: built on meta (no vocab x dim allocation) and given the embedding's Parameter below.
        device = "meta" if args.tie_embeddings else None
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False, device=device)
        self.tie_weights()
        # Derived from args, so never saved: checkpoints hold weights only.
        self.register_buffer("rope_cache", rope_table(args), persistent=False)

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding's Parameter again (when tied and both are here).

        Anything that gives each module a new Parameter undoes a tie: ``to_empty`` (torch 2.13;
        ``init_buffers``, which every caller runs after it, re-ties), ``load_state_dict(assign=True)``,
        tensor parallelism's distribution of each module. Callers of the last two call this afterwards.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
        mtp: bool = False,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens (B, T) ids, or (B, T, dim) hidden states inside a later pipeline stage.

        ``input_pos`` (T,) int64, after ``setup_kv_cache``: the positions of the tokens, which
        attend to the cached positions before them. ``attn_mask`` (training): which keys each
        query sees, the same for every layer (a (B, 1, T, T) bool tensor, True = attend, or a
        FlexAttention BlockMask; see ``document_mask``); None is causal. Returns logits
        (B, T, vocab), or hidden states when this stage has no output layer. ``mtp`` (training, a
        model with prediction depths): returns (logits, [each depth's logits (B, T, vocab)]); at
        position i depth k predicts token i + k + 1, and its last k positions predict nothing.
        ``positions`` (B, T) int64 (training, packed sequences): each token's position in its own
        sequence, restarting at 0 where one begins; RoPE rotates each token by it. None: 0..T-1.
        """
        if input_pos is not None and (attn_mask is not None or positions is not None):
            raise ValueError(
                "attn_mask is for training, and positions too; decoding (input_pos) masks by cached position"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The whole table: under sequence parallel h holds only this rank's part of the sequence.
        rope = self.rope_cache
        if input_pos is not None:
            rope = rope[input_pos]  # (T, head_dim // 2, 2)
        elif positions is not None:
            rope = rope[positions]  # each token's own row: (B, T, head_dim // 2, 2)
        for layer_id, layer in self.layers.items():
            if int(layer_id) < self.args.n_layers:  # the prediction depths' blocks run below
                h = layer(h, rope, input_pos=input_pos, attn_mask=attn_mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if not mtp or self.mtp is None:
            return logits
        return logits, self.predict_ahead(tokens, h, rope, attn_mask)

    def predict_ahead(
        self, tokens: torch.Tensor, h: torch.Tensor, rope: torch.Tensor, attn_mask: torch.Tensor | BlockMask | None
    ) -> list[torch.Tensor]:
        """Each prediction depth's logits (B, T, vocab), from the tokens and the main model's hidden
        states ``h`` after its final norm (see ``forward``)."""
        depth_logits = []
        for k, depth in self.mtp.items():
            # Position i takes token i + k + 1 (rolled: the last k + 1 positions wrap around to the
            # window's start, and attention is causal, so they change no earlier position).
            ahead = self.tok_embeddings(tokens.roll(-(int(k) + 1), dims=1))
            h = depth.norm(self.layers[str(self.args.n_layers + int(k))](depth(h, ahead), rope, attn_mask=attn_mask))
            depth_logits.append(self.output(h))
        return depth_logits

    def setup_kv_cache(self, max_seq_len: int | None = None, batch_size: int = 1) -> None:
        """Give every main layer's attention a zeroed KV cache of ``max_seq_len`` positions (default: the RoPE
        table's); the prediction depths' blocks get none, decoding runs the main layers only.

        Its heads are those the attention's ``wk`` produces, so a sharded ``wk`` gets a cache of
        its own heads only.
        """
        length = max_seq_len or self.rope_cache.shape[0]
        if length > self.rope_cache.shape[0]:
            raise ValueError(f"a {length}-position cache needs ModelArgs.max_seq_len >= {length}")
        for layer_id, layer in self.layers.items():
            if int(layer_id) < self.args.n_layers:
                layer.attention.cache = layer.attention.new_cache(batch_size, length)

    def clear_kv_cache(self) -> None:
        for layer in self.layers.values():
            layer.attention.cache = None

    def param_inits(self, depth: int | None) -> dict[str, ParamInit]:
        """The embedding table and the output layer (the blocks' modules answer for their own)."""
        args = self.args
        # Tied: small, as transformers and torchtitan draw a tied table (initializer_range 0.02). At
        # init the residual stream is mostly the token's own embedding e, and the final norm scales it
        # to unit RMS, so e's own logit is ~std * dim: as the output layer's dim^-1/2 it would be
        # ~sqrt(dim) and the first loss ~10.7, not ln V = 8.4 (debugmodel). named_parameters lists a
        # tied table once, under tok_embeddings.
        embedding = ParamInit("normal", std=0.02 if args.tie_embeddings else 1.0)
        std = args.dim**-0.5
        return {"tok_embeddings.weight": embedding, "output.weight": ParamInit("trunc_normal", std=std, bound=3 * std)}

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (after ``to_empty`` left it uninitialized) and re-tie a tied
        table (``to_empty`` gives each module its own new Parameter)."""
        device = device if device is not None else self.rope_cache.device
        self.rope_cache = rope_table(self.args, torch.device(device))
        for block in self.layers.values():
            if block.moe is not None:  # state buffers: zero until balancing moves them, or tokens arrive
                block.moe.expert_bias.zero_()
                block.moe.tokens_per_expert.zero_()
        self.tie_weights()


def split_into_stage(model: Transformer, layer_ids: Iterable[int], is_first: bool, is_last: bool) -> Transformer:
    """A copy of ``model`` holding only ``layer_ids`` (plus embeddings if first, norm and output if last).

    Meant for a model on the meta device: the deep copy then costs no memory.
    """
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    missing = keep - set(stage.layers.keys())
    if missing:
        raise ValueError(f"the model has no layers {sorted(int(i) for i in missing)}")
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    stage.mtp = None  # a pipeline has no place for prediction depths (check_layout refuses them)
    return stage
