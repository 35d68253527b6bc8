"""`titanctl estimate-memory`'s estimator, in five parts:

- ``estimate``: the recipe on a fake process group and fake tensors, rank 0's peak, and ``validate``;
- ``tracker``: torch's memory trackers plus where (phase, module, pipeline action) the peak happened;
- ``fake``: torch's FakeTensorMode, with its dispatch cache keys built faster (the same keys);
- ``pipeline``: answers a lone rank 0's pipeline stages would otherwise wait for from their peers,
  and labels the schedule's actions for the tracker;
- ``shortcuts``: which shallower models and shorter pipeline schedules stand for the full step.
"""

from titanctl.planning.memory.estimate import (
    MemoryEstimate,
    Plan,
    Validation,
    check_validation_world,
    estimate_memory,
    fake_process_group,
    plan_estimate,
    rss_peak_bytes,
    run_estimate,
    validate,
)

__all__ = [
    "MemoryEstimate",
    "Plan",
    "Validation",
    "check_validation_world",
    "estimate_memory",
    "fake_process_group",
    "plan_estimate",
    "rss_peak_bytes",
    "run_estimate",
    "validate",
]
