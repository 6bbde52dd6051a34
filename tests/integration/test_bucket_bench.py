"""`brigade bench bucket`: at one round against the session's moto server every figure is there and
the server's CPU is read from its process; end to end through the command (`--quick --repeat 2
--json`, its own moto server) it runs twice and its last line is the flat summary. The timings
themselves are not checked here: a shared CI machine is too noisy to assert on a 10 % margin, so the
targets are judged by `brigade bench` from its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from brigade_bench import bucket as bench
from brigade_bench.system import process_cpu_s
from brigade_cli.main import app


def test_process_cpu_counts_this_process_and_not_a_gone_one():
    before = process_cpu_s(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.05   # 10 ms ticks: well inside 0.1 s
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert process_cpu_s(int(gone.stdout)) is None
    assert process_cpu_s(None) is None


@pytest.mark.asyncio(loop_scope="session")
async def test_one_round_reports_the_server_cpu(s3_bucket_url, s3_server):
    out = await bench._bench(s3_bucket_url, rounds=1, server_pid=s3_server.proc.pid)
    for key in ("put_ratio", "get_ratio", "get_buffer_ratio", "get_unverified_ratio", "sha256_ms", "raw_get_ms"):
        assert out[key] > 0
    assert out["raw_get_server_cpu_ms"] >= 0 and 0 < out["raw_get_busy"] <= 1.5   # ticks round up or down
    no_server = await bench._bench(s3_bucket_url, rounds=1, server_pid=None)
    assert "raw_get_busy" not in no_server and no_server["get_ratio"] > 0


def test_bench_bucket_quick_repeated() -> None:
    res = CliRunner().invoke(app, ["bench", "bucket", "--quick", "--repeat", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("size_mib", "rounds", "put_mb_s", "get_mb_s", "raw_put_mb_s", "raw_get_mb_s", "put_ratio", "get_ratio"):
        assert key in out, key
    assert out["size_mib"] == 34 and out["rounds"] == 5 and out["get_cpu_ms"] > 0
    assert all(out[k] > 0 for k in ("put_mb_s", "get_mb_s", "raw_put_mb_s", "raw_get_mb_s", "put_ratio", "get_ratio"))
    # two runs: the median of each figure, its worst run, and the load average around each run
    assert out["repeat"] == 2 and "runs_failed" not in out
    assert out["get_ratio_worst"] >= out["get_ratio"] and out["get_mb_s_worst"] <= out["get_mb_s"]
    assert len(out["load_before"].split(",")) == 2 and len(out["load_after"].split(",")) == 2
