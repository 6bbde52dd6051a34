"""The create-only probe: every versioned object (adapters, rollouts, checkpoints, run.pb) is
written once through `put_new`, which on S3 is a PUT with `If-None-Match: *`. A store that ignores
the header answers 200 to a second write and silently overwrites, so every service that writes a
create-only object checks once, at start, that the store refuses one: the learner, each rollout
worker, the aggregator, each local trainer, the proxy (run.pb and the prompts, when it has a bucket)
and the evaluator (its results). The janitor writes no object.

The probe's object is `keys.probe_key(run, <uuid4>)`: a fresh key per check, so on a store that
honours the header it is written exactly once (the second put is the one refused). Nothing reads it.
"""

from __future__ import annotations

import uuid

from brigade import keys
from brigade.bucket.base import Bucket, BucketError, ObjectExists
from brigade.config import ConfigError
from brigade.retry import Backoff, retry


class CreateOnlyIgnored(BucketError, ConfigError):
    """The store accepted a second create-only put of one key: it cannot hold a brigade run."""


async def check_create_only(bucket: Bucket, run: str) -> str:
    """Put a new probe key twice, create-only; the second put must be refused. Returns the key.
    Raises CreateOnlyIgnored (one line naming the store and the guarantee) when it is not, and
    BucketError when the store cannot be reached (the caller decides whether to retry)."""
    key = keys.probe_key(run, uuid.uuid4().hex)
    try:
        await bucket.put_new(key, b"brigade create-only probe: first put\n")
    except ObjectExists:
        pass  # a fresh key: only our own first put, retried after its answer was lost, can be there
    try:
        # different bytes, so an echo of our own first put can never pass for a refusal
        await bucket.put_new(key, b"brigade create-only probe: this second put must be refused\n")
    except ObjectExists:
        return key
    raise CreateOnlyIgnored(
        f"the bucket store {bucket.describe()} accepted a second create-only put (If-None-Match: *) of one key; "
        "brigade needs a store that refuses it (412), or versioned objects would be silently overwritten",
        key=key, uri=bucket.url(key))


async def probe_at_start(bucket: Bucket, run: str, attempts: int = 10) -> str:
    """check_create_only as a service runs it at start: asked again with backoff while the store
    hiccups (any BucketError), never after a CreateOnlyIgnored (a ConfigError: exit 2, one line)."""
    return await retry(lambda: check_create_only(bucket, run), backoff=Backoff(base_s=0.2, cap_s=5.0),
                       attempts=attempts,
                       retryable=lambda e: isinstance(e, BucketError) and not isinstance(e, CreateOnlyIgnored))
