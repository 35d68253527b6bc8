"""Document (block-causal) attention masks for windows packed from several documents.

The loader packs documents as BOS + text + EOS back to back and cuts the stream into windows,
so a window's documents can be read off its tokens: a new document starts at every BOS. A
token attends to the tokens of its own document up to itself, never across a boundary:

- a BOS opens its document (it sees only itself); an EOS belongs to the document it closes;
- the tokens before a window's first BOS (the tail of a document begun in an earlier window)
  are one more document;
- the loss is unchanged: the EOS position still learns to predict the next document's BOS.

Positions (RoPE) keep counting across the window. RoPE scores depend only on the distance
between a query and a key, so a document gives the same outputs wherever it sits in the window.

Three forms of the same mask, for the kernels that can apply it:
- span: a ``SpanMask`` (span_mask.py), each position's document start, O(B T): ``span_attention``
  attends each chunk of queries to the keys its rows can see, making the chunk's block from the
  starts. Used on CPU, where torch 2.13's FlexAttention has no backward ("FlexAttention does not
  support backward on CPU"); over the whole sequence in order only.
- dense: a (B, 1, T_q, T_kv) bool tensor for ``scaled_dot_product_attention``, B x T_q x T_kv bytes
  (references in tests, and any order of positions).
- block: a FlexAttention ``BlockMask``, which skips fully masked tiles (other devices).

``q_positions`` / ``kv_positions`` say where in the window each query / key of the attention
call sits (default: all of it, in order). Context parallelism passes a rank's share of the
positions for queries and the gathered order for keys; the model itself never needs them.
The mask is per (batch, query, key) and the same for every head, so a tensor-parallel split of
the heads needs nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titanctl.models.common.span_mask import SpanMask

ATTN_MASK_TYPES = ("causal", "block_causal")
MASK_FORMS = ("span", "dense", "block")


def document_ids(tokens: Tensor, bos_id: int) -> Tensor:
    """(B, T) token ids -> (B, T) int64: how many BOS tokens occur at or before each position."""
    return (tokens == bos_id).cumsum(dim=1)


def _positions(given: Tensor | None, length: int, device: torch.device) -> Tensor:
    return torch.arange(length, device=device) if given is None else given.to(device)


def dense_document_mask(
    doc_ids: Tensor, q_positions: Tensor | None = None, kv_positions: Tensor | None = None
) -> Tensor:
    """(B, 1, T_q, T_kv) bool, True where the query may attend to the key."""
    q_pos = _positions(q_positions, doc_ids.shape[1], doc_ids.device)  # (T_q,)
    kv_pos = _positions(kv_positions, doc_ids.shape[1], doc_ids.device)  # (T_kv,)
    same_document = doc_ids[:, q_pos, None] == doc_ids[:, None, kv_pos]  # (B, T_q, T_kv)
    not_later = kv_pos[None, :] <= q_pos[:, None]  # (T_q, T_kv)
    return (same_document & not_later).unsqueeze(1)  # (B, 1, T_q, T_kv)


def block_document_mask(
    doc_ids: Tensor, q_positions: Tensor | None = None, kv_positions: Tensor | None = None
) -> BlockMask:
    """The same mask as a FlexAttention BlockMask (heads broadcast: H = 1)."""
    q_pos = _positions(q_positions, doc_ids.shape[1], doc_ids.device)
    kv_pos = _positions(kv_positions, doc_ids.shape[1], doc_ids.device)

    def allowed(b, h, q_idx, kv_idx):
        q, kv = q_pos[q_idx], kv_pos[kv_idx]
        return (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)

    return create_block_mask(
        allowed, doc_ids.shape[0], None, q_pos.numel(), kv_pos.numel(), device=doc_ids.device.type
    )


def mask_form_for(device: torch.device) -> str:
    """"span" on CPU (FlexAttention cannot run backward there in torch 2.13), else "block"."""
    return "span" if torch.device(device).type == "cpu" else "block"


def build_document_mask(
    doc_ids: Tensor, form: str, q_positions: Tensor | None = None, kv_positions: Tensor | None = None
) -> SpanMask | Tensor | BlockMask:
    """The block-causal mask of ``doc_ids`` (B, T) in ``form`` (span: over every position in order)."""
    if form not in MASK_FORMS:
        raise ValueError(f"unknown document mask form {form!r}; choose one of {', '.join(MASK_FORMS)}")
    if form == "span":
        if q_positions is not None or kv_positions is not None:
            raise ValueError("a span document mask covers every position in order; use form dense for others")
        return SpanMask.of_documents(doc_ids)
    build = dense_document_mask if form == "dense" else block_document_mask
    return build(doc_ids, q_positions, kv_positions)


def document_mask(
    tokens: Tensor,
    bos_id: int,
    *,
    form: str | None = None,
    q_positions: Tensor | None = None,
    kv_positions: Tensor | None = None,
) -> SpanMask | Tensor | BlockMask:
    """The block-causal mask of a microbatch of whole windows ``tokens`` (B, T), in ``form``
    (default: the form for the tokens' device), for the model's ``attn_mask`` argument."""
    return build_document_mask(document_ids(tokens, bos_id), form or mask_form_for(tokens.device), q_positions,
                               kv_positions)
