"""Bucket objects mirrored into the local cache, for what `from_pretrained` and `datasets` read
from a local path: a model folder, a dataset file or a `save_to_disk` folder."""

from __future__ import annotations

import asyncio
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade"))


@contextmanager
def build_lock(out: Path):
    """Several services may start at once on one machine: one builds `out` (a cached model), the
    others wait on `out`.lock and reuse it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def is_bucket_uri(name: str) -> bool:
    return name.startswith(("s3://", "file://"))


async def _download(url: str, dest: Path, key: str) -> None:
    from brigade.bucket import open_bucket

    async with open_bucket(url) as bucket:
        keys = [key] if key else await bucket.list("")
        if not keys:
            raise FileNotFoundError(f"no files under {url}")
        for k in keys:
            target = dest / k
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(await bucket.get(k))


def mirror(uri: str, kind: str, single_file: bool = False) -> Path:
    """The local copy of a bucket prefix (or, with `single_file`, of one object) under
    cache/{kind}/, downloaded once: a complete copy is renamed into place, so a crash midway
    leaves only a `.partial` folder that the next call replaces."""
    safe = uri.split("://", 1)[1].strip("/").replace("/", "__")
    dest = cache_dir() / kind / safe
    url, _, key = uri.rstrip("/").rpartition("/") if single_file else (uri, "", "")
    local = dest / key if single_file else dest
    if not dest.exists():
        partial = dest.with_name(dest.name + ".partial")
        asyncio.run(_download(url, partial, key))
        partial.rename(dest)
    return local
