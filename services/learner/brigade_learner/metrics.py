"""The learner's Prometheus metrics (served with --metrics-port): what an operator watches to see
whether the learner or the rollout fleet is the bottleneck."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from brigade.prom import LATENCY_BUCKETS

STEPS = Counter("brigade_learner_steps_total", "Optimizer steps taken")
STEP_SECONDS = Histogram("brigade_learner_step_duration_seconds", "Wall time of one step (waiting included)",
                         buckets=LATENCY_BUCKETS)
WAIT_FRACTION = Gauge("brigade_learner_wait_fraction", "Share of the last step spent waiting for rollouts")
STALENESS = Gauge("brigade_learner_staleness_mean", "Mean staleness (learner versions) of the last step's batches")
STEP = Gauge("brigade_learner_step", "The learner's current step")
REWARD = Gauge("brigade_learner_reward_mean", "Mean reward of the last step's samples")
TOKENS_PER_S = Gauge("brigade_learner_tokens_per_second", "Training throughput of the last step")
SAMPLES = Counter("brigade_learner_accepted_samples_total", "Samples trained on")
REJECTED = Counter("brigade_learner_rejected_batches_total", "Batches rejected at ingestion")


def observe_step(m: dict[str, Any]) -> None:
    STEPS.inc()
    STEP.set(m["step"])
    STEP_SECONDS.observe(m["step_s"])
    WAIT_FRACTION.set(m["wait_frac"])
    STALENESS.set(m["staleness_mean"])
    REWARD.set(m["reward_mean"])
    TOKENS_PER_S.set(m.get("tokens_per_s", 0.0))
    SAMPLES.inc(m["accepted_samples"])
    REJECTED.inc(m["rejected_batches"])
