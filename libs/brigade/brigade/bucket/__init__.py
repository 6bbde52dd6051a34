"""brigade.bucket: one async object-store interface over S3 (aiobotocore) and a local folder.

    async with open_bucket("s3://name/runs") as b:
        digest = await b.put_new("adapters/v00000001/adapter_model.safetensors", blob)
        blob = await b.get("adapters/v00000001/adapter_model.safetensors", sha256=digest)
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from brigade.bucket.base import Bucket, BucketError, CorruptObject, ObjectExists, ObjectNotFound, sha256_hex
from brigade.bucket.probe import CreateOnlyIgnored, check_create_only, probe_at_start

__all__ = [
    "Bucket",
    "BucketError",
    "CorruptObject",
    "CreateOnlyIgnored",
    "ObjectExists",
    "ObjectNotFound",
    "check_create_only",
    "probe_at_start",
    "open_bucket",
    "sha256_hex",
]


_S3_ONLY_OPTIONS = frozenset(
    {"page_size", "multipart_threshold", "part_size", "max_concurrency", "endpoint_url", "region"}
)


def open_bucket(url: str | os.PathLike[str], **options: Any) -> Bucket:
    """A Bucket for "s3://name/prefix", "file:///abs/path", "file://./relative/path" or a plain
    filesystem path.

    No IO happens here: the S3 client is created on first use (in the caller's event loop),
    and neither the bucket nor the folder is created until `ensure()` or the first write.
    `options` go to the backend (S3: page_size, multipart_threshold, part_size,
    max_concurrency, endpoint_url, region).
    """
    text = os.fspath(url)
    if text.startswith("s3://"):
        from brigade.bucket.s3 import S3Bucket  # aiobotocore is only imported when S3 is used

        return S3Bucket(text, **options)
    from brigade.bucket.local import LocalBucket

    # S3 tuning knobs mean nothing to a folder; dropping them lets callers pass one set of
    # options whatever the URL (anything else still fails loudly in the constructor).
    options = {k: v for k, v in options.items() if k not in _S3_ONLY_OPTIONS}
    if text.startswith("file:"):
        parts = urlsplit(text)
        if parts.netloc == ".":  # file://./folder: relative to the working directory (the default --bucket)
            return LocalBucket(os.path.abspath("." + unquote(parts.path)), **options)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must name a local absolute path: {text!r}")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"file URL must name an absolute path: {text!r}")
        return LocalBucket(path, **options)
    if "://" in text:
        raise ValueError(f"unsupported bucket URL scheme: {text!r} (use s3:// or file://)")
    return LocalBucket(text, **options)
