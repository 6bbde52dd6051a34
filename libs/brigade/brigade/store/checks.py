"""Every check of a request's fields, before it reaches Redis: ids, stream ids, batch ids, the
worker's self-description, run specs, rollout and adapter manifests. Each raises InvalidArgument
with a message that names the field."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from brigade import keys
from brigade.config import ConfigError
from brigade.spec import validate_spec
from brigade.store.errors import InvalidArgument
from brigade.v1 import brigade_pb2 as pb

MAX_ID_CHARS = 256            # worker, learner, lease, batch and run ids
MAX_IDS_PER_ACK = 10_000
MAX_METRICS_JSON = 1_000_000  # bytes of one AckRollouts' metrics_json
STREAM_ID_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


def short(value: str, limit: int = 80) -> str:
    """`value` quoted for a message, cut at `limit` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def check_short(name: str, value: str) -> str:
    """At most MAX_ID_CHARS characters (empty is fine)."""
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{name} is {len(value)} characters long; the limit is {MAX_ID_CHARS}")
    return value


def check_id(name: str, value: str) -> str:
    """A non-empty id of at most MAX_ID_CHARS printable characters."""
    if not value:
        raise InvalidArgument(f"{name} is required")
    check_short(name, value)
    if not value.isprintable():
        raise InvalidArgument(f"{name} {short(value)} contains control characters")
    return value


def check_stream_id(name: str, value: str) -> str:
    check_id(name, value)
    if not STREAM_ID_RE.match(value):
        raise InvalidArgument(f"{name} {short(value)} is not a stream entry id like '1712345678901-0'")
    return value


def check_batch_id(run: str, value: str) -> str:
    check_id("batch id", value)
    try:
        batch_run, _, _ = keys.parse_batch_id(value)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    if batch_run != run:
        raise InvalidArgument(f"batch id {short(value)} belongs to another run")
    return value


def check_lease_ref(run: str, lease_id: str, worker: str) -> None:
    """The three ids every Heartbeat, CompleteLease and FailLease carries."""
    check_id("run_id", run)
    check_stream_id("lease_id", lease_id)
    check_id("worker_id", worker)


def check_worker_info(info: pb.WorkerInfo) -> None:
    """What a worker says about itself on AcquireLease."""
    check_short("capacity_class", info.capacity_class)
    check_short("engine", info.engine)
    if not math.isfinite(info.price_per_hour) or info.price_per_hour < 0:
        raise InvalidArgument("price_per_hour must be a finite number >= 0")


def check_fail_reason(reason: int) -> bool:
    """FailLease's reason; True if it is a preemption (which does not count toward max_attempts)."""
    if reason not in (pb.FailLeaseRequest.ERROR, pb.FailLeaseRequest.PREEMPTED):
        raise InvalidArgument("reason must be ERROR or PREEMPTED")
    return reason == pb.FailLeaseRequest.PREEMPTED


def check_metrics_json(value: str) -> str:
    if len(value) > MAX_METRICS_JSON:
        raise InvalidArgument("metrics_json is larger than 1 MB")
    return value


def check_ack_ids(run: str, delivery_ids: Sequence[str], consumed: Sequence[str], rejected: Sequence[str]) -> None:
    if len(delivery_ids) + len(consumed) + len(rejected) > MAX_IDS_PER_ACK:
        raise InvalidArgument(f"at most {MAX_IDS_PER_ACK} ids per AckRollouts")
    for d in delivery_ids:
        check_stream_id("delivery id", d)
    for b in (*consumed, *rejected):
        check_batch_id(run, b)


def check_run_spec(spec: pb.RunSpec, prompts: Sequence[pb.Prompt]) -> None:
    try:
        validate_spec(spec)
    except ConfigError as e:
        raise InvalidArgument(str(e)) from None
    if not prompts:
        raise InvalidArgument("a run needs at least one prompt (CreateRunRequest.prompts is empty)")


def require_manifest(m: pb.RolloutManifest | pb.AdapterManifest | None) -> None:
    """CompleteLease and PublishAdapter must carry one (an absent message field arrives as None)."""
    if m is None:
        raise InvalidArgument("manifest is required")


def check_manifest_worker(worker: str, m: pb.RolloutManifest | None) -> None:
    """A CompleteLease request's manifest names the worker that sends it (or no worker). The proxy
    checks this; the store itself answers a foreign worker with FailedPrecondition (not its lease)."""
    if m is not None and m.worker_id and m.worker_id != worker:
        raise InvalidArgument("manifest worker_id does not match the request's worker_id")


def check_rollout_manifest(run: str, m: pb.RolloutManifest) -> None:
    """Everything about a rollout manifest that does not depend on the lease: the proxy checks it
    on CompleteLease, the learner again before it reads the object the manifest points at."""
    problems = _run_mismatch(run, m.run_id)
    if not m.batch_id or len(m.batch_id) > MAX_ID_CHARS:
        problems.append("batch_id is required (at most 256 characters)")
    else:
        try:
            batch_run, _, _ = keys.parse_batch_id(m.batch_id)
            if batch_run != run:
                problems.append(f"batch {short(m.batch_id)} belongs to run {batch_run!r}")
        except ValueError as e:
            problems.append(str(e))
    if m.attempt < 1:
        problems.append("attempt must be >= 1")
    expected_uri = keys.rollout_key(run, m.batch_id, m.attempt)
    if m.uri != expected_uri:
        problems.append(f"uri {short(m.uri)} must be exactly {expected_uri!r}")
    expected_text = keys.rollout_text_key(run, m.batch_id, m.attempt)
    if m.text_uri and m.text_uri != expected_text:
        problems.append(f"text_uri {short(m.text_uri)} must be empty or exactly {expected_text!r}")
    if not HEX64_RE.match(m.sha256):
        problems.append(f"sha256 {short(m.sha256)} must be 64 lowercase hex characters")
    if m.num_samples < 1:
        problems.append("num_samples must be > 0")
    for name in ("reward_mean", "compute_seconds", "price_per_hour"):
        if not math.isfinite(getattr(m, name)):
            problems.append(f"{name} must be a finite number")
    if m.compute_seconds < 0 or m.price_per_hour < 0:
        problems.append("compute_seconds and price_per_hour must be >= 0")
    _refuse("rollout", problems)


def check_adapter_manifest(run: str, m: pb.AdapterManifest) -> None:
    problems = _run_mismatch(run, m.run_id)
    if m.version < 1:
        problems.append("version must be >= 1 (0 is the base adapter, never published)")
    folder = keys.adapter_prefix(run, m.version).rstrip("/")
    uri = m.uri.rstrip("/")
    # the key itself, or a full URI (s3://bucket/prefix/..., file:///...) that ends with it
    inside = (uri == folder or uri.endswith("/" + folder)) and "/../" not in uri + "/" and "/./" not in uri + "/"
    if not inside:
        problems.append(f"uri {short(m.uri)} must be the adapter folder {keys.adapter_prefix(run, m.version)!r} "
                        "(or a bucket URI ending with it)")
    _refuse("adapter", problems)


def _run_mismatch(run: str, manifest_run: str) -> list[str]:
    if manifest_run != run:
        return [f"run_id {short(manifest_run)} does not match the request's run {run!r}"]
    return []


def _refuse(kind: str, problems: list[str]) -> None:
    if problems:
        raise InvalidArgument(f"invalid {kind} manifest: " + "; ".join(problems))
