"""The proxy, the janitor and `brigade ctl` must start without torch or transformers, and fast."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

CHECK = (
    "import brigade_proxy.server, brigade_proxy.cli, brigade_janitor.janitor, brigade_janitor.cli, brigade_cli.ctl, "
    "brigade.store, brigade_cli.main, brigade_bench.proxy; import sys; "
    "bad = sorted(m for m in ('torch', 'transformers', 'peft', 'safetensors', 'numpy') if m in sys.modules); "
    "assert not bad, bad"
)


def _run(*args: str) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds of the child, result)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def test_control_plane_imports_without_torch():
    _, _, proc = _run("-c", CHECK)
    assert proc.returncode == 0, proc.stderr


def test_ctl_help_and_proxy_import_are_fast():
    """~0.3 s on an idle machine. CPU time is what the code costs; wall time on a shared 2-core
    machine also measures the neighbours, so it only gets a loose bound."""
    _run("-c", "import brigade_cli.main")  # warm the file cache
    for args in (["-m", "brigade_cli.main", "ctl", "--help"], ["-c", "import brigade_proxy.server"],
                 ["-m", "brigade_cli.main", "proxy", "--help"], ["-m", "brigade_cli.main", "janitor", "--help"]):
        runs = [_run(*args) for _ in range(2)]
        assert all(r[2].returncode == 0 for r in runs), runs[0][2].stderr
        cpu = min(r[1] for r in runs)
        wall = min(r[0] for r in runs)
        assert cpu < 0.8 and wall < 3.0, (args, cpu, wall)
