"""`brigade bench learner` runs the real step and data path; a miniature configuration here."""

from __future__ import annotations

import math

import pytest

from brigade_bench import learner as bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")




async def test_bench_learner_reports_step_against_bare():
    cfg = dict(bench.QUICK, hidden=32, layers=1, heads=2, intermediate=64, vocab=256, prompts=2, group=2,
               completion_len=8, rounds=2)
    out = await bench._bench(cfg, beta=0.0)
    for key in ("step_s", "bare_s", "overhead_ratio", "tokens_per_s", "wait_s"):
        assert math.isfinite(out[key]) and out[key] >= 0, key
    assert out["step_s"] > 0 and out["bare_s"] > 0 and out["loss_finite"] == 1
    assert out["rounds"] == 2 and out["tokens_per_step"] > 0
