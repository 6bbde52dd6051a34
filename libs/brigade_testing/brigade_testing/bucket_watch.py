"""The bucket of a chaos run, read directly from moto (no faults in between): `BucketWatcher` records
the sha256 of every write-once object the moment it appears, so that overwriting one later is caught."""

from __future__ import annotations

import hashlib
import threading

from brigade import keys
from brigade_harness.devservers import MOTO_ENV


def s3_client(endpoint: str):
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=MOTO_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 5}))


def list_keys(client, bucket: str, prefix: str) -> list[str]:
    out: list[str] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", ())]
    except client.exceptions.NoSuchBucket:
        return []
    return out


class BucketWatcher(threading.Thread):
    """Polls the run's prefix and records sha256 of each write-once object when first seen.

    Write-once here: everything under adapters/, each complete checkpoint's manifest.json, and
    every rollout object. (Other checkpoint files may be replaced until their manifest exists.)"""

    def __init__(self, endpoint: str, bucket: str, root: str, run: str, interval: float = 0.5):
        super().__init__(name="bucket-watcher", daemon=True)
        self.client = s3_client(endpoint)
        self.bucket, self.interval = bucket, interval
        self.prefix = f"{root}/{keys.run_prefix(run)}"
        self.first_seen: dict[str, str] = {}
        self.changed: list[str] = []
        self.damaged: set[str] = set()  # written over on purpose by a test (a damaged checkpoint)
        self.polls = 0
        self._halt = threading.Event()

    @staticmethod
    def write_once(rel: str) -> bool:
        return (rel.startswith(("adapters/", "rounds/", "contributions/"))
                or (rel.startswith("checkpoints/") and rel.endswith("/manifest.json"))
                or (rel.startswith("rollouts/") and rel.endswith(".safetensors")))

    def _digest(self, key: str) -> str | None:
        try:
            return hashlib.sha256(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()).hexdigest()
        except self.client.exceptions.NoSuchKey:
            return None

    def poll(self, recheck: bool = False) -> None:
        for key in list_keys(self.client, self.bucket, self.prefix):
            rel = key[len(self.prefix):]
            if not self.write_once(rel):
                continue
            if rel not in self.first_seen:
                digest = self._digest(key)
                if digest is not None:
                    self.first_seen[rel] = digest
            elif recheck and rel not in self.damaged and self._digest(key) != self.first_seen[rel]:
                self.changed.append(rel)
        self.polls += 1

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a poll racing moto's shutdown; the final check is what counts
                pass
            self._halt.wait(self.interval)

    def finish(self) -> list[str]:
        """Stop polling, then read every recorded object once more: the ones that changed (none may)."""
        self._halt.set()
        self.join(10)
        self.poll(recheck=True)
        return self.changed
