"""`brigade up` with every service, the evaluator included: every line of every service log is JSON
(a log shipper parses them all), and each service said something."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_every_line_of_every_service_log_is_json(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")
    proc = subprocess.run(
        [sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--run", "jsonlogs", "--max-steps", "6",
         "--workers", "1", "--out", str(out), "--max-wall", "300"],
        capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((out / "logs").glob("*.log"))
    assert {p.stem for p in logs} >= {"proxy", "janitor", "learner", "rollout-0", "evaluator"}
    for path in logs:
        lines = path.read_text().splitlines()
        # the evaluator may still be importing torch when a 6-step run ends on a loaded machine
        assert lines or path.stem == "evaluator", f"{path.name} is empty"
        for n, line in enumerate(lines, 1):
            try:
                event = json.loads(line)
            except ValueError:
                raise AssertionError(f"{path.name}:{n} is not JSON: {line[:300]!r}") from None
            assert {"event", "level", "timestamp", "service"} <= set(event), f"{path.name}:{n}: {line[:300]}"
