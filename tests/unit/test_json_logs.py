"""JSON log mode: every line a service writes to stderr is one JSON object, whoever writes it."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging, warnings
from brigade.log import configure_logging
log = configure_logging("learner", "info", json=True)
log.info("structlog line", n=1)
logging.getLogger("botocore.credentials").warning("a stdlib logger: %s", "formatted")
warnings.warn("a python warning", FutureWarning)
from transformers.utils import logging as hf_logging
hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
from transformers.utils.logging import tqdm
for _ in tqdm(range(3), desc="Loading weights"):
    pass
import os
print(os.environ["GRPC_VERBOSITY"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"], flush=True)
raise RuntimeError("boom")
"""


def test_every_stderr_line_is_json():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.split() == ["NONE", "1"]  # grpc-core and the progress bars silenced before they load
    lines = [json.loads(line) for line in proc.stderr.splitlines()]  # raises on any line that is not JSON
    events = [e["event"] for e in lines]
    assert "structlog line" in events
    assert "a stdlib logger: formatted" in events
    assert any("a python warning" in e for e in events)
    assert "a transformers warning" in events
    assert not any("Loading weights" in e for e in events)
    crash = lines[-1]
    assert crash["event"] == "uncaught" and crash["error"] == "RuntimeError: boom"
    assert "Traceback" in crash["exception"] and crash["service"] == "learner"
