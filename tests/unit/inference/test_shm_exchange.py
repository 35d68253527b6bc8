"""The shared-memory exchange of inference tensor parallel, in one process: what fits in a slot,
and a peer that never arrives is a clear error rather than a hang (the exchange itself is checked
against gloo's all-gather under torchrun in tests/distributed/test_infer_tp.py)."""

from __future__ import annotations

import mmap

import pytest
import torch

from titanctl.inference import shm_exchange


def lone_rank(tp: int = 2) -> shm_exchange.SharedMemoryExchange:
    """Rank 0 of a ``tp``-rank segment whose other ranks never come."""
    size = shm_exchange._header_bytes(tp) + 2 * tp * shm_exchange.SLOT_BYTES
    return shm_exchange.SharedMemoryExchange(mmap.mmap(-1, size), rank=0, tp=tp, key=-1)


def test_tensors_up_to_a_slot_fit():
    exchange = lone_rank()
    assert exchange.fits(shm_exchange.SLOT_BYTES) and not exchange.fits(shm_exchange.SLOT_BYTES + 1)


def test_a_missing_peer_is_named_after_the_timeout(monkeypatch):
    monkeypatch.setattr(shm_exchange, "TIMEOUT_SECONDS", 0.2)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 did not reach collective 1 within 0 s"):
        lone_rank().all_gather(torch.ones(4))
