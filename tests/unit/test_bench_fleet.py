"""The fleet benchmark's account of the sync run's luck: which batch of each step the straggler drew."""

from __future__ import annotations

import pytest

from brigade_bench import fleet
from brigade_bench.system import Event
from brigade_testing.slow_engine import DelayModel


def _rows(t0: float, tokens_by_factor: list[tuple[float, int]]) -> list[dict]:
    return [{"t0": t0 + 0.01 * i, "factor": f, "tokens": n} for i, (f, n) in enumerate(tokens_by_factor)]


def test_assignment_luck_compares_each_step_with_every_assignment_of_its_batches():
    delay = DelayModel(per_token_s=0.025)
    events = [Event("AdapterPublished", 10.0, {"version": "1"}), Event("LeaseGranted", 10.1, {}),
              Event("AdapterPublished", 20.0, {"version": "2"})]
    engine = [
        # step 0: the straggler drew the long batch: 3 x 40 = 120 tokens against 1/4 x 120 + 3/4 x 40 = 60 at random
        *_rows(1.0, [(1.0, 10), (1.0, 10), (1.0, 10), (3.0, 40)]),
        # step 1: it drew a short one: max(3 x 10, 40) = 40 against 60
        *_rows(11.0, [(1.0, 40), (1.0, 10), (1.0, 10), (3.0, 10)]),
        # step 2: a fast worker ran two batches and the straggler none: not counted
        *_rows(21.0, [(1.0, 10), (1.0, 10), (1.0, 10), (1.0, 10)]),
    ]
    luck, counted = fleet.assignment_luck_s(engine, events, delay)
    assert counted == 2
    assert luck == pytest.approx((60 - 120 + 60 - 40) * 0.025)
    assert fleet.assignment_luck_s([], events, delay) == (0.0, 0)
