"""Smoke test of `brigade bench bucket --quick --repeat 2 --json`: the benchmark runs end to end
against a real S3 API, twice, through the CLI's repeat runner, and the last line is the flat summary.
(Speed targets are checked by reading its figures, not here: a shared CI machine is too noisy to
assert on a 10% margin.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from brigade_cli.main import app


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
