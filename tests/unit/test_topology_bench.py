"""`brigade bench topology`'s pure pieces: rewards over the first / last batches whatever a step
holds, and what the bucket carries for each topology."""

from __future__ import annotations

import pytest

from brigade_bench.topology import reward_by_batches, topology_spec, traffic


def test_reward_by_batches_weights_steps_by_the_batches_they_hold():
    central = [{"step": s, "reward_mean": s / 10, "accepted_batches": 1} for s in range(1, 11)]
    assert reward_by_batches(central, 3, last=True) == pytest.approx(0.9)
    assert reward_by_batches(central, 2, last=False) == pytest.approx(0.15)
    rounds = [{"step": 1, "reward_mean": 0.2, "accepted_batches": 8}, {"step": 2, "reward_mean": 0.6, "accepted_batches": 8}]
    assert reward_by_batches(rounds, 12, last=True) == pytest.approx((8 * 0.6 + 4 * 0.2) / 12)
    assert reward_by_batches(rounds, 100, last=False) == pytest.approx(0.4)


def test_traffic_counts_writes_and_the_reads_each_design_makes():
    sizes = {"rollouts": 1000, "adapters": 100, "checkpoints": 50, "contributions": 300, "rounds": 70}
    assert traffic(sizes, rollout_read=800, k=2, topology="central") == (1000 + 100 + 800 + 2 * 100, 50)
    assert traffic(sizes, rollout_read=800, k=4, topology="local_sgd") == (300 + 100 + 300 + 4 * 100, 70)


def test_the_same_sample_budget_for_both_topologies():
    central = topology_spec("central", 2, "c", 96, 4)
    local = topology_spec("local_sgd", 4, "l", 96, 4)
    assert central.max_steps * central.batches_per_step == 96
    assert local.max_steps * 4 * local.local_sgd.local_steps == 96 and local.local_sgd.min_contributions == 4
