"""torch's FakeTensorMode, with its dispatch cache keys built faster: the same keys.

A training step on fake tensors is some 10^5 ops, nearly all answered from FakeTensorMode's
dispatch cache. Building the key of each (the op and the metadata of every argument) is the larger
half of a cache hit: torch fills a ``TensorMetadata`` per tensor argument, then walks its fields
with ``dataclasses.fields``, recursing into shapes and strides. ``FastKeyFakeTensorMode`` writes
the same key values directly, for the arguments an estimate's ops take (this mode's own fake
tensors, strided, without symbolic shapes; Python scalars, dtypes, devices; lists and tuples of
those); anything else, and every op when the mode has a shape environment, goes through torch's
own code. ``CROSSCHECK`` makes every key be built both ways and compared (the tests).
"""

from __future__ import annotations

import dataclasses

import torch

from titanctl._torch_compat import (
    FAKE_TENSOR,
    FAKE_TENSOR_METADATA,
    FAKE_TENSOR_MODE,
    PREP_ARGS_FOR_HASH,
    SUGGEST_MEMORY_FORMAT,
)

FakeTensorMode = FAKE_TENSOR_MODE.get()
FakeTensor = FAKE_TENSOR.get()
_torch_prep_args_for_hash = PREP_ARGS_FOR_HASH.get()
suggest_memory_format = SUGGEST_MEMORY_FORMAT.get()

# The fields of torch's TensorMetadata, in the order the key lists them (what _append_tensor writes).
METADATA_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
    "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
    "dense_dim", "sparse_dim",
)
# Argument types torch's key holds as (type, value), with no other check applying to them.
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_CONTIGUOUS = torch.contiguous_format
_STRIDED = torch.strided
_SIZE = torch.Size


def fast_keys_apply() -> bool:
    """Whether this torch's key has the layout written here (else torch's own code builds it)."""
    return tuple(f.name for f in dataclasses.fields(FAKE_TENSOR_METADATA.get())) == METADATA_FIELDS


class FastKeyFakeTensorMode(FakeTensorMode):
    """FakeTensorMode whose cache keys are built by ``_prep_args_for_hash`` below (same values)."""

    CROSSCHECK = False  # build every key both ways and compare (tests)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if not self.CROSSCHECK:
            self._fast_prep(result, args, state, id_hashed_objects)
            return
        theirs: list = []
        _torch_prep_args_for_hash(self, theirs, args, state, id_hashed_objects)
        ours: list = []
        self._fast_prep(ours, args, state, id_hashed_objects)
        if ours != theirs or list(map(type, ours)) != list(map(type, theirs)):
            raise AssertionError(f"fast fake-tensor cache key differs from torch's:\n{ours}\n{theirs}")
        result.extend(ours)

    def _fast_prep(self, result, args, state, id_hashed_objects) -> None:
        kind = type(args)
        if self.shape_env is not None or (kind is not tuple and kind is not list):
            _torch_prep_args_for_hash(self, result, args, state, id_hashed_objects)
            return
        append = result.append
        append(kind)
        append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if kind is FakeTensor and arg.fake_mode is self and arg.constant is None and arg.layout == _STRIDED:
                self._append_tensor(result, arg)
            elif kind in _PLAIN:
                append(kind)
                append(arg)
            elif kind is tuple or kind is list:
                self._fast_prep(result, arg, state, id_hashed_objects)
            else:  # one argument, through torch's code (an iterator: no type or length of its own)
                _torch_prep_args_for_hash(self, result, iter((arg,)), state, id_hashed_objects)

    @staticmethod
    def _append_tensor(result: list, t) -> None:
        """What torch's ``extract_tensor_metadata(t)._flatten_into(result, ...)`` appends, for a
        strided fake tensor without symbolic sizes (the mode has no shape environment)."""
        shape, stride = t.shape, t.stride()
        memory_format = suggest_memory_format(t) if len(shape) in (4, 5) else _CONTIGUOUS
        if not t.is_contiguous(memory_format=memory_format):
            memory_format = None
        result += (t.dtype, _SIZE, f"length_{len(shape)}")
        for size in shape:
            result += (int, size)
        result += (tuple, f"length_{len(stride)}")
        for step in stride:
            result += (int, step)
        result += (
            t.device, _STRIDED, memory_format, t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), False, None, None, None,
        )


def fake_tensor_mode(**kwargs):
    """A FakeTensorMode for estimating: ``FastKeyFakeTensorMode`` where this torch's keys allow."""
    return (FastKeyFakeTensorMode if fast_keys_apply() else FakeTensorMode)(**kwargs)
