"""What FSDP's float8 settings really did in a run, recorded from inside the Trainer.

The float8 all-gather and the precomputed scale give the same numbers as the plain path, so losses
cannot tell whether they ran: this looks at the objects instead. ``Float8Probe(trainer)`` before
``trainer.train()`` (it patches the instance and torchao, reading no tensor on the host in the
loop), ``probe.report()`` after (a collective: every rank calls it), then ``probe.close()`` (torchao
as it was, for the next run of the process); the tests check reports with
``check_float8_all_gathers`` and ``check_no_float8_all_gathers``. The report:

- ``weights``: the type of every float8 linear's weight, as its FSDP shard holds it (the local
  tensor of the DTensor): ``WeightWithDynamicFloat8CastTensor`` makes FSDP all-gather it in float8;
- ``events``: ``["optimizer", step]`` and ``["precompute", step, part, fresh, weights]`` in call order,
  ``fresh`` being how many of the part's float8 weights got a new precomputed scale in that call;
- ``all_gathers``: per step, ``[pre-all-gather calls, of which used a precomputed scale, of which
  produced float8]`` (torchao's hook FSDP calls on each float8 weight before gathering it);
- ``final_scales_equal``: whether every precomputed scale after the last step equals float8 e4m3's
  max / the amax of the whole (unsharded) weight after the last optimizer step; None without any.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanctl.parallel.converters.float8 import is_float8_linear, torchao_float8

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight._local_tensor if isinstance(weight, DTensor) else weight


class Float8Probe:
    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.linears = [[m for m in part.modules() if is_float8_linear(m)] for part in trainer.model_parts]
        self.weights = [type(_local(m.weight)).__name__ for part in self.linears for m in part]
        self.events: list[list] = []
        self.all_gathers: dict[int, list[int]] = {}
        self._restore: list = []  # (owner, name, original) of each patched global
        self._patch_optimizer()
        self._patch_precompute()
        self._patch_pre_all_gather()

    def _step(self) -> int:
        return self.trainer.step + 1  # the step being run (Trainer.step counts finished ones)

    def _patch_optimizer(self) -> None:
        optimizer = self.trainer.optimizer
        step = optimizer.step

        def recorded(*args, **kwargs):
            result = step(*args, **kwargs)
            self.events.append(["optimizer", self._step()])
            return result

        optimizer.step = recorded

    def _patch_precompute(self) -> None:
        f8 = torchao_float8()
        precompute = f8.precompute_float8_dynamic_scale_for_fsdp
        self._restore.append((f8, "precompute_float8_dynamic_scale_for_fsdp", precompute))
        parts = self.trainer.model_parts

        def recorded(module):
            index = next(i for i, part in enumerate(parts) if part is module)
            weights = [m.weight for m in self.linears[index]]
            before = [getattr(_local(w), "_precomputed_scale", None) for w in weights]
            precompute(module)
            after = [getattr(_local(w), "_precomputed_scale", None) for w in weights]
            fresh = sum(a is not None and a is not b for a, b in zip(after, before))
            self.events.append(["precompute", self._step(), index, fresh, len(weights)])

        f8.precompute_float8_dynamic_scale_for_fsdp = recorded

    def _patch_pre_all_gather(self) -> None:
        wrapper = torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor
        pre_all_gather = wrapper.fsdp_pre_all_gather
        self._restore.append((wrapper, "fsdp_pre_all_gather", pre_all_gather))
        probe = self

        @functools.wraps(pre_all_gather)  # FSDP reads the hook's signature to decide how to call it
        def recorded(self, *args, **kwargs):
            precomputed = self._precomputed_scale is not None
            outputs, metadata = pre_all_gather(self, *args, **kwargs)
            counts = probe.all_gathers.setdefault(probe._step(), [0, 0, 0])
            counts[0] += 1
            counts[1] += precomputed
            counts[2] += outputs[0].dtype in FLOAT8_DTYPES
            return outputs, metadata

        wrapper.fsdp_pre_all_gather = recorded

    def close(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def _final_scales_equal(self) -> bool | None:
        weights = [m.weight for part in self.linears for m in part]
        scales = [getattr(_local(w), "_precomputed_scale", None) for w in weights]
        if not weights or any(s is None for s in scales):
            return None if all(s is None for s in scales) else False
        amax = torch.stack([_local(w)._tensor.detach().abs().max() for w in weights])
        if dist.is_initialized():  # every rank holds a shard of each weight (no pipeline here)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        expected = (torch.finfo(torch.float8_e4m3fn).max / amax.double()).float()
        return torch.equal(torch.stack(scales), expected)

    def report(self) -> dict:
        return {
            "weights": self.weights,
            "events": self.events,
            "all_gathers": self.all_gathers,
            "final_scales_equal": self._final_scales_equal(),
        }


def check_float8_all_gathers(probe: dict, steps: int, linears: int, precomputed: bool = True) -> None:
    """A report of a run of ``steps`` steps with ``linears`` float8 linears in one model part:
    float8.enable_fsdp_float8_all_gather ran, and float8.precompute_float8_dynamic_scale_for_fsdp
    ran if ``precomputed`` and not otherwise."""
    # Every float8 weight's shard is torchao's wrapper, which FSDP all-gathers in float8 ...
    assert probe["weights"] == ["WeightWithDynamicFloat8CastTensor"] * linears
    gathers = {int(step): counts for step, counts in probe["all_gathers"].items()}
    assert sorted(gathers) == list(range(1, steps + 1))
    for step, (calls, with_precomputed, float8) in gathers.items():
        assert calls >= linears and float8 == calls, (step, gathers)  # each weight, at least in forward
        # ... with the scale precomputed after the previous step's optimizer step (none before step 1).
        assert with_precomputed == (calls if precomputed and step > 1 else 0), (step, gathers)
    # One precompute per step and model part, right after the optimizer step, renewing every scale.
    expected = []
    for step in range(1, steps + 1):
        expected.append(["optimizer", step])
        if precomputed:
            expected.append(["precompute", step, 0, linears, linears])
    assert probe["events"] == expected
    # Computed from the weights after the last optimizer step.
    assert probe["final_scales_equal"] is (True if precomputed else None)


def check_no_float8_all_gathers(probe: dict, linears: int) -> None:
    """The same float8 linears, with both FSDP float8 settings off: plain shards, nothing precomputed."""
    assert len(probe["weights"]) == linears
    assert "WeightWithDynamicFloat8CastTensor" not in probe["weights"]
    assert probe["all_gathers"] == {}
    assert [e for e in probe["events"] if e[0] == "precompute"] == []
    assert probe["final_scales_equal"] is None
