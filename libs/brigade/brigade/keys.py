"""Names shared by every service: Redis keys, bucket layout, batch ids and seeds (DESIGN.md)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# ---------------------------------------------------------------- Redis (prefix brigade:{<run>}:)
#
# Every key of a run carries the run id as a Redis Cluster hash tag (`brigade:{demo}:work`), so a
# run's keys share one hash slot and every Lua script stays within one slot; different runs spread
# over the cluster. The global keys below are single keys, never touched by a script with a run's.

WORK_GROUP = "rollout"          # consumer group on `work`: a pending entry is a lease
LEARNER_GROUP = "learner"       # consumer group on `rollouts`, and on `contributions` (the aggregator is local_sgd's learner)
RUN_INDEX = "brigade:run-index"  # sorted set, every score 0: the run ids of this Redis in byte order (pages)
# hash: `run:<run>` -> the credential that created it, `n:<credential>` -> how many it created
# (runs per credential, with the proxy's tokens file; one key, so one slot on Redis Cluster)
RUN_OWNERS = "brigade:run-owners"
JANITOR_LOCK = "brigade:janitor:lock"  # string: the id of the janitor that sweeps
# the layout before the hash tags: run keys were `brigade:<run>:<name>` and the runs a plain
# set; `brigade migrate-keys` moves such data to the layout above, and services refuse to start on it
LEGACY_RUNS_SET = "brigade:runs"


def legacy_run_prefix(run: str) -> str:
    return f"brigade:{run}:"


@dataclass(frozen=True)
class RunKeys:
    run: str

    @property
    def prefix(self) -> str:        # `brigade:{run}:`, the hash tag making the run one slot
        return "brigade:{" + self.run + "}:"

    def _k(self, name: str) -> str:
        return self.prefix + name

    @property
    def work(self) -> str:          # stream of PromptBatch entries, group `rollout`
        return self._k("work")

    @property
    def rollouts(self) -> str:      # stream of RolloutManifest entries, group `learner`
        return self._k("rollouts")

    @property
    def contributions(self) -> str:  # local_sgd: stream of ContributionManifest entries, group `learner`
        return self._k("contributions")

    @property
    def events(self) -> str:        # capped stream of Event
        return self._k("events")

    @property
    def deadletter(self) -> str:    # stream of dead batches with reason
        return self._k("deadletter")

    @property
    def adapter_latest(self) -> str:  # string: newest published version
        return self._k("adapter:latest")

    @property
    def adapters(self) -> str:      # hash version -> AdapterManifest bytes
        return self._k("adapters")

    @property
    def completed(self) -> str:     # set of completed batch ids
        return self._k("completed")

    @property
    def consumed(self) -> str:      # set of batch ids the learner trained on
        return self._k("consumed")

    @property
    def spec(self) -> str:          # RunSpec bytes
        return self._k("spec")

    @property
    def prompts(self) -> str:       # list of Prompt bytes, in dataset order
        return self._k("prompts")

    @property
    def cursor(self) -> str:        # counter: batches cut so far
        return self._k("cursor")

    @property
    def stats(self) -> str:         # hash of counters (expired, revoked, rejected, workers: ids kept, ...)
        return self._k("stats")

    @property
    def workers(self) -> str:       # hash info:/seen:/granted:/completed: + worker id (pruned when idle)
        return self._k("workers")

    @property
    def metrics(self) -> str:       # stream of learner step metrics (JSON)
        return self._k("metrics")

    @property
    def evals(self) -> str:         # hash version -> evaluator results (JSON)
        return self._k("evals")

    @property
    def rejected(self) -> str:      # hash batch id -> reason: dropped as stale or invalid (terminal)
        return self._k("rejected")

    @property
    def learner_step(self) -> str:  # string: last checkpointed learner step
        return self._k("learner:step")

    @property
    def lease_deadlines(self) -> str:  # sorted set lease id -> deadline_ms: what the janitor expires
        return self._k("lease_deadlines")

    @property
    def lease_versions(self) -> str:   # sorted set lease id -> adapter version: what the janitor revokes
        return self._k("lease_versions")

    def lease(self, lease_id: str) -> str:  # hash: worker, batch, version, deadline, attempt
        return self._k(f"leases:{lease_id}")


# ---------------------------------------------------------------- bucket (prefix runs/{run}/)

def run_prefix(run: str) -> str:
    return f"runs/{run}/"


def reward_queue(run: str) -> str:
    """The rq queue of a run's sandboxed reward jobs (rq keeps it as `rq:queue:<this>`)."""
    return f"brigade:{run}:rewards"


def run_spec_key(run: str) -> str:
    return f"runs/{run}/run.pb"


def prompts_key(run: str) -> str:
    return f"runs/{run}/prompts/prompts.pb"


def adapter_prefix(run: str, version: int) -> str:
    return f"runs/{run}/adapters/v{version:08d}/"


def adapter_manifest_key(run: str, version: int) -> str:
    return adapter_prefix(run, version) + "manifest.pb"


def rollout_key(run: str, batch_id: str, attempt: int) -> str:
    return f"runs/{run}/rollouts/{batch_id}/attempt-{attempt}.safetensors"


def rollout_text_key(run: str, batch_id: str, attempt: int) -> str:
    return f"runs/{run}/rollouts/{batch_id}/attempt-{attempt}.json"


def contribution_key(run: str, base_version: int, contribution: str) -> str:
    """A local trainer's trained factors after its local steps from `base_version` (local_sgd)."""
    return f"runs/{run}/contributions/v{base_version:08d}/{contribution}.safetensors"


def base_adapter_key(run: str) -> str:
    """local_sgd: the seeded v0 adapter every process builds (A and B, float32, with its
    adapter_config.json), written once by the first trainer; the aggregator starts from it."""
    return f"runs/{run}/contributions/v0.safetensors"


def round_key(run: str, version: int) -> str:
    """The aggregator's record of the round that made `version` (its state after that round)."""
    return f"runs/{run}/rounds/v{version:08d}.safetensors"


def checkpoint_prefix(run: str, step: int, attempt: int = 0) -> str:
    """The folder of a step's checkpoint. A retrain of a step whose checkpoint was found damaged
    writes its own folder beside it (`step-00000005.1/`, `.2/`, ...): nothing is ever overwritten."""
    return f"runs/{run}/checkpoints/step-{step:08d}{f'.{attempt}' if attempt else ''}/"


def eval_key(run: str, version: int) -> str:
    return f"runs/{run}/evals/v{version:08d}.json"


def eval_queue(run: str) -> str:
    """The rq queue of a run's evaluation jobs (the evaluator's watcher fills it, its worker drains it)."""
    return f"brigade-evals:{run}"


def eval_job_id(run: str, version: int) -> str:
    """One job per version: a second enqueue of it is a no-op, and `brigade up` finds it by this id."""
    return f"eval-{run}-v{version}"


def evaluates(version: int, step: int, eval_every: int, max_steps: int) -> bool:
    """Whether the evaluator scores adapter `version` (published at learner `step`): every
    `eval_every`-th, and the run's last, so a run always ends with a held-out score."""
    return eval_every > 0 and version > 0 and (version % eval_every == 0 or (max_steps > 0 and step >= max_steps))


def metrics_key(run: str, step: int) -> str:
    return f"runs/{run}/metrics/step-{step:08d}.json"


def probe_key(run: str, token: str) -> str:
    """The create-only probe's object (brigade.bucket.probe): one per service start, written once,
    read by nobody; safe to expire with a lifecycle rule."""
    return f"runs/{run}/probe/{token}"


# ---------------------------------------------------------------- batches and seeds

# the one definition of a batch id: acquire.lua cuts batches with it (string.format), so Lua and
# Python agree on %s / %d
BATCH_ID_FORMAT = "%s:%d:%d"


def batch_id(run: str, epoch: int, index: int) -> str:
    return BATCH_ID_FORMAT % (run, epoch, index)


def parse_batch_id(value: str) -> tuple[str, int, int]:
    """Inverse of batch_id; ValueError with the offending value if malformed."""
    run, sep1, rest = value.partition(":")
    epoch, sep2, index = rest.partition(":")
    if not (sep1 and sep2 and epoch.isdigit() and index.isdigit() and run):
        raise ValueError(f"malformed batch id {value!r}, expected '{{run}}:{{epoch}}:{{index}}'")
    return run, int(epoch), int(index)


def contribution_id(run: str, trainer: str, lease_ids: list[str]) -> str:
    """One round of one trainer: its leases are granted once, so their ids name it (32 hex; safe in
    a bucket key whatever the trainer id holds)."""
    return hashlib.sha256("\0".join([run, trainer, *lease_ids]).encode()).hexdigest()[:32]


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def batch_seed(seed: int, batch: str, attempt: int) -> int:
    """The sampling seed of one attempt at a batch: sha256 of the spec's `seed`, the batch's epoch
    and index, and the attempt. Not the run id: two runs of one spec under different ids draw the
    same samples (docs/guarantees.md, reproducibility); a requeued batch (attempt + 1) draws anew."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        # the first argument used to be the run id: a caller still passing one must not hash it quietly
        raise TypeError(f"batch_seed takes the spec's seed (an int), not {type(seed).__name__} {seed!r}")
    _, epoch, index = parse_batch_id(batch)
    return _seed("brigade-batch", seed, epoch, index, attempt)


def eval_seed(seed: int, version: int) -> int:
    """The evaluator's sampling seed for adapter `version`: the same for every run of one spec,
    and never a batch's (its own prefix), so a version's score is reproducible from the spec."""
    return _seed("brigade-eval", int(seed), version)
