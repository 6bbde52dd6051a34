"""The sync-latency benchmark's control: the side that reads with the sha256 check off, and the
figures that say what the check costs."""

from __future__ import annotations

import hashlib

import pytest

from brigade import keys
from brigade.bucket import CorruptObject, open_bucket
from brigade_bench import notes, sync_latency


@pytest.mark.parametrize("read", ["get", "get_buffer"])  # read_version: the manifest, then the files
async def test_the_control_side_skips_the_check_only_in_the_folders_it_names(tmp_path, read):
    bucket = open_bucket(str(tmp_path))
    unchecked = keys.adapter_prefix("r", 2)
    for v in (1, 2):
        await bucket.put(keys.adapter_prefix("r", v) + "w", b"bytes")
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    folders: set[str] = set()
    sync_latency.uncheck_reads(bucket, folders)
    get = getattr(bucket, read)
    with pytest.raises(CorruptObject):
        await get(unchecked + "w", sha256=wrong)
    folders.add(unchecked)  # what the bench's "unchecked" command does before it publishes v2
    assert await get(unchecked + "w", sha256=wrong) == b"bytes"
    with pytest.raises(CorruptObject):
        await get(keys.adapter_prefix("r", 1) + "w", sha256=wrong)


def test_control_figures_from_the_rounds():
    s = {"ours": [[0.30, 0.40]], "unchecked": [[0.25, 0.33], [0.20, 0.31]], "raw": [[0.2, 0.3], [0.1, 0.2]],
         "cpu_ms": {"ours": [400.0, 180.0], "unchecked": [260.0, 190.0], "raw": [220.0, 178.0]}, "sha256_ms": 31.0,
         "faults": {"ours": 33000.4, "unchecked": 32000.0, "raw": 24000.0}}
    got = sync_latency._control("7b", s)
    assert got["7b_unchecked_all_p50_ms"] == pytest.approx(320.0)  # the median of the rounds' slowest workers
    assert got["7b_unchecked_ratio"] == pytest.approx(0.32 / 0.25)
    assert (got["7b_client_cpu_ms"], got["7b_unchecked_client_cpu_ms"], got["7b_raw_client_cpu_ms"]) == (400, 260, 220)
    assert (got["7b_s3_cpu_ms"], got["7b_unchecked_s3_cpu_ms"], got["7b_raw_s3_cpu_ms"]) == (180, 190, 178)
    assert (got["7b_faults"], got["7b_unchecked_faults"], got["7b_raw_faults"]) == (33000, 32000, 24000)
    lone = {f"7b_1w_{k[3:]}": v for k, v in got.items()}
    r = {**got, **lone, "workers": 4, "7b_busy": 0.77}
    note = notes._sync_control(r)
    assert "1.28x raw with 4 workers" in note and "costs one core 31 ms" in note
    assert notes._sync_control({}) == ""
