import math

import pytest
import torch

from titanctl.config.job_config import LRScheduler
from titanctl.train.lr_schedule import build_lr_scheduler, lr_factor


def factors(total, **kw):
    cfg = LRScheduler(**kw)
    return [lr_factor(s, total_steps=total, cfg=cfg) for s in range(total)]


def test_linear_warmup_then_linear_decay_to_zero():
    f = factors(10, warmup_steps=4, decay_type="linear")
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    # 6 decay steps, reaching lr_min (0) at the last step
    assert f[4:] == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])


def test_wsd_keeps_peak_until_decay():
    f = factors(10, warmup_steps=2, decay_ratio=0.3, decay_type="linear", lr_min=0.1)
    assert f[2:7] == [1.0] * 5
    assert f[7:] == pytest.approx([0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1])


def test_cosine_and_sqrt_shapes():
    cos = factors(5, warmup_steps=0, decay_type="cosine")
    assert cos == pytest.approx([0.5 * (1 + math.cos(math.pi * p / 5)) for p in range(1, 6)])
    sq = factors(4, warmup_steps=0, decay_type="sqrt")
    assert sq == pytest.approx([1 - math.sqrt(p / 4) for p in range(1, 5)])


def test_warmup_longer_than_run():
    f = factors(3, warmup_steps=10)
    assert f == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_scheduler_drives_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2, decay_type="linear"), total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2 / 3, 4 / 3, 1.0, 0.0])


def test_past_the_last_step_stays_at_lr_min():
    cfg = LRScheduler(warmup_steps=1, decay_type="linear", lr_min=0.1)
    assert lr_factor(10, total_steps=5, cfg=cfg) == pytest.approx(0.1)
