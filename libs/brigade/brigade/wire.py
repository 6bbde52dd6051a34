"""The wire contract, beside the run spec: every check of a request's fields before it reaches Redis
or a service acts on it (ids, stream ids, batch ids, the worker's self-description, run specs, rollout,
contribution and adapter manifests), imported alike by the proxy, the store, the learner and the
aggregator. Each check raises InvalidArgument with a message that names the field.

`WIRE_BOUNDS` declares, once, the bound of every string, bytes, list and map field of every
request message (characters, bytes or entries), and integers are held to `MAX_SAFE_INT` unless
listed; `check_wire` applies the table to a whole request as the proxy parses it, so nothing
unbounded gets as far as a handler, Redis or Lua. The limits table in docs/ is made from it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from brigade import keys
from brigade.config import ConfigError
from brigade.errors import InvalidArgument
from brigade.spec import MAX_PROMPTS, MAX_ROUND_LEASES, validate_spec
from brigade.v1 import brigade_pb2 as pb

MAX_ID_CHARS = 256            # worker, learner, lease, batch and run ids
MAX_IDS_PER_ACK = 10_000
MAX_METRICS_JSON = 16_384     # UTF-8 bytes of one AckRollouts' metrics_json (a step's metrics are ~2 KB)
METRICS_KEPT = 1_000          # steps of metrics kept in Redis and returned by GetMetrics: 16 MB a run at most
MAX_SAFE_INT = 2**53 - 1      # Lua numbers are doubles: an integer above this is rounded, or wraps
MAX_TEXT = 65_536             # characters of a FailLease message (its first 500 are kept)
MAX_LABEL = 64                # capacity_class, engine, payload and the spec's choice fields
MAX_URI = 1_024
MAX_RUNS = 1_000              # runs one Redis holds; CreateRun beyond it is RESOURCE_EXHAUSTED
MAX_MANIFEST_BYTES = 8_192    # a rollout manifest with every field at its bound (tests/unit/test_wire_bounds.py)
MAX_CONTRIBUTION_BYTES = 144 << 10  # a contribution manifest with every field at its bound
STREAM_ID_RE = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
HEX64_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Bound:
    """The most a field may hold: characters of a string, bytes, entries of a list or map, or the
    largest integer. `printable` refuses control characters too (ids and labels)."""

    limit: int
    doc: str
    printable: bool = False
    entries_unchecked: bool = False  # a list whose entries only the request's size limit bounds
    unit: str = "characters"         # or "entries" (a list or map), "" (an integer)


def _id(doc: str) -> Bound:
    return Bound(MAX_ID_CHARS, doc, printable=True)


def _label(doc: str) -> Bound:
    return Bound(MAX_LABEL, doc, printable=True)


# "Message.field" -> its bound; "Message.field[]" is each entry of a repeated string field
WIRE_BOUNDS: dict[str, Bound] = {
    # ids, everywhere
    **{f"{m}.run_id": _id("a run id") for m in (
        "AcquireLeaseRequest", "HeartbeatRequest", "CompleteLeaseRequest", "FailLeaseRequest", "PullRolloutsRequest",
        "AckRolloutsRequest", "PublishAdapterRequest", "RunSpec", "RunRef", "WatchRunRequest", "GetMetricsRequest",
        "RolloutManifest", "AdapterManifest", "SubmitContributionRequest", "ContributionManifest",
        "PullContributionsRequest")},
    **{f"{m}.worker_id": _id("a worker id") for m in (
        "AcquireLeaseRequest", "HeartbeatRequest", "CompleteLeaseRequest", "FailLeaseRequest", "RolloutManifest")},
    **{f"{m}.lease_id": _id("a lease id (a work stream entry id)") for m in (
        "HeartbeatRequest", "CompleteLeaseRequest", "FailLeaseRequest")},
    "PullRolloutsRequest.learner_id": _id("a learner id"),
    "AckRolloutsRequest.learner_id": _id("a learner id"),
    "WatchRunRequest.after_id": _id("an event id"),
    "ListRunsRequest.page_token": Bound(2 * MAX_ID_CHARS, "the previous page's next_page_token", printable=True),
    "ListRunsRequest.page_size": Bound(MAX_RUNS, "runs per page (0 = 100)", unit=""),
    "RolloutManifest.batch_id": _id("a batch id"),
    # the worker's self-description, kept per worker and shown by `ctl workers`
    **{f"{m}.{f}": _label(f"a worker's {f}") for m in ("AcquireLeaseRequest", "RolloutManifest")
       for f in ("capacity_class", "engine")},
    "RolloutManifest.adapter_payload": _label("the adapter payload a rollout was generated with"),
    "RolloutManifest.uri": Bound(MAX_URI, "the rollout object's key", printable=True),
    "RolloutManifest.text_uri": Bound(MAX_URI, "the rollout's text sidecar key", printable=True),
    "RolloutManifest.sha256": Bound(64, "hex digest", printable=True),
    "FailLeaseRequest.message": Bound(MAX_TEXT, "why a lease failed (the first 500 characters are kept)"),
    # local_sgd: a trainer's round, and the aggregator's pulls (it acks with AckRollouts)
    **{f"{m}.trainer_id": _id("a trainer's worker id") for m in ("SubmitContributionRequest", "ContributionManifest")},
    "SubmitContributionRequest.lease_ids": Bound(MAX_ROUND_LEASES, "leases of one contribution", unit="entries"),
    "SubmitContributionRequest.lease_ids[]": _id("a lease id"),
    "ContributionManifest.contribution_id": _id("a contribution id (32 hex)"),
    "ContributionManifest.batch_ids": Bound(MAX_ROUND_LEASES, "batches of one contribution", unit="entries"),
    "ContributionManifest.batch_ids[]": _id("a batch id"),
    "ContributionManifest.empty_batch_ids": Bound(MAX_ROUND_LEASES, "its batches with no usable sample",
                                                  unit="entries"),
    "ContributionManifest.empty_batch_ids[]": _id("a batch id"),
    "ContributionManifest.uri": Bound(MAX_URI, "the contribution object's key", printable=True),
    "ContributionManifest.sha256": Bound(64, "hex digest", printable=True),
    "ContributionManifest.capacity_class": _label("a trainer's capacity_class"),
    "PullContributionsRequest.aggregator_id": _id("an aggregator id"),
    # the learner's side
    "AckRolloutsRequest.delivery_ids": Bound(MAX_IDS_PER_ACK, "delivery ids of one ack", unit="entries"),
    "AckRolloutsRequest.delivery_ids[]": _id("a delivery id"),
    "AckRolloutsRequest.consumed_batch_ids": Bound(MAX_IDS_PER_ACK, "consumed batch ids of one ack", unit="entries"),
    "AckRolloutsRequest.consumed_batch_ids[]": _id("a batch id"),
    "AckRolloutsRequest.rejected_batch_ids": Bound(MAX_IDS_PER_ACK, "rejected batch ids of one ack", unit="entries"),
    "AckRolloutsRequest.rejected_batch_ids[]": _id("a batch id"),
    "AckRolloutsRequest.metrics_json": Bound(MAX_METRICS_JSON, "one step's metrics, kept in Redis"),
    "AckRolloutsRequest.step": Bound(MAX_SAFE_INT, "also: one commit past the stored step, or what the consumed batches make", unit=""),
    "AdapterManifest.uri": Bound(MAX_URI, "the adapter folder", printable=True),
    "AdapterManifest.payload": _label("bf16 or int8"),
    "AdapterManifest.files": Bound(64, "files of one adapter version", unit="entries"),
    "AdapterManifest.version": Bound(MAX_SAFE_INT, "also: the latest version + 1, or a republish", unit=""),
    "AdapterFile.name": Bound(MAX_ID_CHARS, "a file name", printable=True),
    "AdapterFile.sha256": Bound(64, "hex digest", printable=True),
    # CreateRun
    # prompts are data, stored as sent: checking each of a million would hold the event loop for a
    # second, so their text and columns are bounded by the CreateRun message's size alone
    "CreateRunRequest.prompts": Bound(MAX_PROMPTS, "prompts of one run (each bounded by the message size)",
                                      entries_unchecked=True, unit="entries"),
    "RunSpec.model": Bound(MAX_URI, "a model id, folder or URI", printable=True),
    "RunSpec.dataset": Bound(MAX_URI, "a dataset path or URI", printable=True),
    "RunSpec.eval_dataset": Bound(MAX_URI, "a dataset path or URI", printable=True),
    "RunSpec.seed": Bound(2**64 - 1, "any uint64 (hashed in Python, never given to Lua)", unit=""),
    "RunSpec.rewards": Bound(64, "reward functions of one run", unit="entries"),
    "RunSpec.report_to": Bound(8, "experiment trackers", unit="entries"),
    "RunSpec.report_to[]": _label("one of the spec's choices"),
    "RewardSpec.function": Bound(MAX_ID_CHARS, "a reward function's name", printable=True),
    "RewardSpec.kwargs": Bound(MAX_TEXT, "a reward factory's arguments, a JSON object"),
    "RunSpec.revision": Bound(MAX_ID_CHARS, "a model branch, tag or commit", printable=True),
    "RunSpec.hub_model_id": Bound(MAX_ID_CHARS, "a Hub repository id", printable=True),
    **{f"RunSpec.{f}": Bound(MAX_ID_CHARS, "a dataset split, column or configuration name", printable=True)
       for f in ("dataset_split", "eval_split", "prompt_column", "dataset_config")},
    "EnvironmentSpec.tools": Bound(64, "tools of one run", unit="entries"),
    "EnvironmentSpec.tools[]": Bound(MAX_ID_CHARS, "a tool's import path", printable=True),
    "EnvironmentSpec.factory": Bound(MAX_ID_CHARS, "an environment class's import path", printable=True),
    "EnvironmentSpec.factories": Bound(MAX_TEXT, "environment classes by name, a JSON object"),
    "EnvironmentSpec.tool_format": _label("one of the spec's choices"),
    "LoraSpec.target_modules": Bound(256, "module names", unit="entries"),
    "LoraSpec.target_modules[]": Bound(MAX_ID_CHARS, "a module name", printable=True),
    **{f"{m}.{f}": _label("one of the spec's choices") for m, f in (
        ("RunSpec", "dtype"), ("RunSpec", "device"), ("RunSpec", "adapter_payload"), ("GrpoSpec", "loss_agg"),
        ("GrpoSpec", "scale_rewards"), ("GrpoSpec", "lr_schedule"), ("RunSpec", "topology"), ("LocalSgdSpec", "merge"),
        ("LocalSgdSpec", "outer_optimizer"))},
}


_STRING = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
_WIDE_INT = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _scalar_problem(owner: str, bound: Bound, is_string: bool, value) -> str | None:
    if is_string:
        if len(value) > bound.limit:
            return f"{owner} is {len(value)} long; the limit is {bound.limit}"
        if bound.printable and not value.isprintable():
            return f"{owner} {short(value)} contains control characters"
    elif abs(value) > bound.limit:
        return f"{owner} is {value}; the limit is {bound.limit}"
    return None


@functools.cache
def _plan(descriptor) -> tuple[tuple, ...]:
    """What to check on a message type, once per type: (name, owner, kind, bound, entry bounds)."""
    plan = []
    for f in descriptor.fields:
        owner = f"{descriptor.name}.{f.name}"
        is_map = bool(f.message_type and f.message_type.GetOptions().map_entry)
        if f.is_repeated:
            if is_map:
                entry = f.message_type
                kv = tuple((f"{entry.name}.{n}", WIRE_BOUNDS[f"{entry.name}.{n}"]) for n in ("key", "value"))
                plan.append((f.name, owner, "map", WIRE_BOUNDS[owner], kv))
            elif f.message_type:
                plan.append((f.name, owner, "messages", WIRE_BOUNDS[owner], None))
            else:
                item = WIRE_BOUNDS.get(owner + "[]", Bound(MAX_SAFE_INT, "")) if f.type in _STRING else None
                plan.append((f.name, owner, "strings" if item else "numbers", WIRE_BOUNDS[owner], item))
        elif f.message_type:
            plan.append((f.name, owner, "message", None, None))
        elif f.type in _STRING:
            plan.append((f.name, owner, "string", WIRE_BOUNDS[owner], None))
        elif f.cpp_type in _WIDE_INT:
            plan.append((f.name, owner, "int", WIRE_BOUNDS.get(owner, Bound(MAX_SAFE_INT, "", unit="")), None))
    return tuple(plan)


def wire_problem(msg: Message) -> str | None:
    """The first field of `msg` (recursively) beyond its declared bound, or None."""
    for name, owner, kind, bound, more in _plan(msg.DESCRIPTOR):
        value = getattr(msg, name)
        if kind == "string" or kind == "int":
            problem = _scalar_problem(owner, bound, kind == "string", value)
        elif kind == "message":
            problem = wire_problem(value) if msg.HasField(name) else None
        elif len(value) > bound.limit:
            problem = f"{owner} has {len(value)} entries; the limit is {bound.limit}"
        elif kind == "messages" and not bound.entries_unchecked:
            problem = next((p for item in value if (p := wire_problem(item))), None)
        elif kind == "strings":
            problem = next((p for item in value if (p := _scalar_problem(owner + "[]", more, True, item))), None)
        elif kind == "map":
            (kn, kb), (vn, vb) = more
            problem = next((p for k, v in value.items()
                            if (p := _scalar_problem(kn, kb, True, k) or _scalar_problem(vn, vb, True, v))), None)
        else:
            problem = None
        if problem:
            return problem
    return None


def check_wire(msg: Message) -> Message:
    """`msg` if every field is within WIRE_BOUNDS; InvalidArgument naming the first that is not."""
    if problem := wire_problem(msg):
        raise InvalidArgument(problem)
    return msg


def short(value: str, limit: int = 80) -> str:
    """`value` quoted for a message, cut at `limit` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def check_short(name: str, value: str) -> str:
    """At most MAX_ID_CHARS printable characters (empty is fine)."""
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{name} is {len(value)} characters long; the limit is {MAX_ID_CHARS}")
    if not value.isprintable():
        raise InvalidArgument(f"{name} {short(value)} contains control characters")
    return value


def check_within(name: str, value: int, limit: int = MAX_SAFE_INT) -> int:
    """An integer Lua holds exactly (the proxy's wire check says the same; this is for direct callers)."""
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{name} is {value}; it must be in [0, {limit}]")
    return value


def check_id(name: str, value: str) -> str:
    """A non-empty id of at most MAX_ID_CHARS printable characters."""
    if not value:
        raise InvalidArgument(f"{name} is required")
    return check_short(name, value)


def check_stream_id(name: str, value: str) -> str:
    check_id(name, value)
    if not STREAM_ID_RE.fullmatch(value):
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
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_METRICS_JSON:
        raise InvalidArgument(f"metrics_json is {size} bytes; the limit is {MAX_METRICS_JSON}")
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
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"a run has at most {MAX_PROMPTS} prompts, got {len(prompts)}")


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
    if problem := wire_problem(m):
        problems.append(problem)
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
    if not HEX64_RE.fullmatch(m.sha256):
        problems.append(f"sha256 {short(m.sha256)} must be 64 lowercase hex characters")
    if m.num_samples < 1:
        problems.append("num_samples must be > 0")
    for name in ("reward_mean", "compute_seconds", "price_per_hour"):
        if not math.isfinite(getattr(m, name)):
            problems.append(f"{name} must be a finite number")
    if m.compute_seconds < 0 or m.price_per_hour < 0:
        problems.append("compute_seconds and price_per_hour must be >= 0")
    _refuse("rollout", problems)


def check_contribution(run: str, trainer: str, lease_ids: Sequence[str], m: pb.ContributionManifest) -> None:
    """SubmitContribution's manifest against its request: its trainer and its leases."""
    problems = []
    if m.trainer_id != trainer:
        problems.append(f"trainer_id {short(m.trainer_id)} is not the submitting trainer {short(trainer)}")
    if len(lease_ids) != len(m.batch_ids):
        problems.append(f"{len(m.batch_ids)} batch_ids for {len(lease_ids)} leases: one per lease")
    if m.contribution_id != keys.contribution_id(run, trainer, list(lease_ids)):
        problems.append("contribution_id must be keys.contribution_id(run, trainer, lease ids)")
    _refuse("contribution", problems)
    check_contribution_manifest(run, m)


def check_contribution_manifest(run: str, m: pb.ContributionManifest) -> None:
    """Everything about a contribution manifest alone: the proxy checks it on SubmitContribution, the
    aggregator again before it reads the object the manifest points at."""
    problems = _run_mismatch(run, m.run_id)
    if problem := wire_problem(m):
        problems.append(problem)
    if not 1 <= len(m.batch_ids) <= MAX_ROUND_LEASES:
        problems.append(f"a contribution has 1 to {MAX_ROUND_LEASES} batch_ids, not {len(m.batch_ids)}")
    for b in m.batch_ids:
        try:
            check_batch_id(run, b)
        except InvalidArgument as e:
            problems.append(str(e))
            break
    if len(set(m.batch_ids)) != len(m.batch_ids) or not set(m.empty_batch_ids) <= set(m.batch_ids):
        problems.append("batch_ids must be distinct, and empty_batch_ids some of them")
    if not re.fullmatch(r"[0-9a-f]{32}", m.contribution_id):
        problems.append(f"contribution_id {short(m.contribution_id)} must be 32 lowercase hex characters")
    expected_uri = keys.contribution_key(run, m.base_version, m.contribution_id)
    if m.uri != expected_uri:
        problems.append(f"uri {short(m.uri)} must be exactly {expected_uri!r}")
    if not HEX64_RE.fullmatch(m.sha256):
        problems.append(f"sha256 {short(m.sha256)} must be 64 lowercase hex characters")
    if not all(math.isfinite(v) for v in (m.reward_mean, m.compute_seconds, m.price_per_hour)):
        problems.append("reward_mean, compute_seconds and price_per_hour must be finite numbers")
    if m.compute_seconds < 0 or m.price_per_hour < 0:
        problems.append("compute_seconds and price_per_hour must be >= 0")
    _refuse("contribution", problems)


def check_adapter_manifest(run: str, m: pb.AdapterManifest) -> None:
    problems = _run_mismatch(run, m.run_id)
    if not 1 <= m.version <= MAX_SAFE_INT:
        problems.append(f"version must be in [1, {MAX_SAFE_INT}] (0 is the base adapter, never published)")
    if m.step > MAX_SAFE_INT:
        problems.append(f"step must be at most {MAX_SAFE_INT}")
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
