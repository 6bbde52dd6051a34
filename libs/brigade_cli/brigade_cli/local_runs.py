"""Runs started by `brigade up` on this machine, found by `brigade ctl` and `brigade cost` without flags.

`up` keeps two files in the run's folder (`./brigade-runs/<run>/` by default):

- `endpoint.json`: where the live run's proxy listens, written when the proxy starts, so `ctl`
  finds a run whose port was picked at random;
- `snapshot.json`: when `up` stops, every RunService answer about the run (GetRun, ListLeases,
  ListWorkers, ListAdapters, ListDeadLetters, GetMetrics, the kept events) as protobuf JSON, so the
  run can still be read once its proxy and Redis are gone. `SnapshotClient` answers from it with
  the same messages the proxy would send.

The token is never written to either file.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from brigade.v1 import brigade_pb2 as pb

RUNS_DIR = Path("brigade-runs")
ENDPOINT = "endpoint.json"
SNAPSHOT = "snapshot.json"
# the snapshot's event replay ends at the first pause this long after an event (the replay is one burst)
REPLAY_GAP_S = 0.5

# RunService method -> its response type; what a snapshot keeps of each
SNAPSHOT_METHODS = {
    "GetRun": pb.RunState,
    "ListLeases": pb.ListLeasesResponse,
    "ListWorkers": pb.ListWorkersResponse,
    "ListAdapters": pb.ListAdaptersResponse,
    "ListDeadLetters": pb.ListDeadLettersResponse,
    "GetMetrics": pb.GetMetricsResponse,
}


@dataclass
class LocalRun:
    run: str
    folder: Path
    proxy: str          # where its proxy listened
    live: bool          # `up` still holds it (its pid runs and it wrote no snapshot since)

    @property
    def snapshot(self) -> Path | None:
        path = self.folder / SNAPSHOT
        return path if path.exists() else None


def write_endpoint(folder: Path, run: str, proxy: str) -> None:
    _write_json(folder / ENDPOINT, {"run": run, "proxy": proxy, "pid": os.getpid(), "started_unix": time.time()})
    (folder / SNAPSHOT).unlink(missing_ok=True)  # a resumed run: the old snapshot is out of date


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)  # a reader never sees half a file


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(folder: Path) -> LocalRun | None:
    try:
        doc = json.loads((folder / ENDPOINT).read_text())
        run, proxy, pid = str(doc["run"]), str(doc["proxy"]), int(doc["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    live = _pid_alive(pid) and not (folder / SNAPSHOT).exists()
    return LocalRun(run, folder, proxy, live)


def find_local_run(run: str = "", runs_dir: Path = RUNS_DIR) -> LocalRun | None:
    """The run `run` of `runs_dir`, or with no run named, the most recently started one."""
    if run:
        return _read(runs_dir / run)
    found = [r for r in (_read(p) for p in sorted(runs_dir.glob("*/"))) if r is not None]
    return max(found, key=lambda r: (r.folder / ENDPOINT).stat().st_mtime, default=None)


async def write_snapshot(folder: Path, client, run: str) -> Path:
    """Every RunService answer about `run`, read through `client` (a ProxyClient), into snapshot.json."""
    ref = pb.RunRef(run_id=run)
    doc: dict[str, Any] = {"run": run, "taken_unix": time.time()}
    for method in SNAPSHOT_METHODS:
        request = pb.GetMetricsRequest(run_id=run) if method == "GetMetrics" else ref
        answer = await getattr(client.runs, method)(request, timeout=10)
        doc[method] = json_format.MessageToDict(answer, preserving_proto_field_name=True)
    import grpc

    events = []
    # the kept events: replayed from the start in one burst, then the stream waits for more, so a
    # quiet gap after the burst (or 3 s without any event) ends it
    stream = client.runs.WatchRun(pb.WatchRunRequest(run_id=run, from_start=True), timeout=10)
    try:
        while True:
            event = await asyncio.wait_for(stream.read(), timeout=REPLAY_GAP_S if events else 3.0)
            if event is grpc.aio.EOF:
                break
            events.append(json_format.MessageToDict(event, preserving_proto_field_name=True))
    except Exception:  # noqa: BLE001 - a gap or the deadline is how a replay of a quiet run ends
        pass
    finally:
        stream.cancel()
    doc["events"] = events
    path = folder / SNAPSHOT
    _write_json(path, doc)
    return path


class _SnapshotRuns:
    """RunService's read methods, answered from a snapshot with the messages the proxy sent."""

    def __init__(self, doc: dict[str, Any]):
        self._doc = doc

    def __getattr__(self, method: str):
        if method == "WatchRun":
            return self._watch
        if method not in SNAPSHOT_METHODS:
            raise AttributeError(method)

        async def answer(request, timeout=None):
            message = json_format.ParseDict(self._doc.get(method, {}), SNAPSHOT_METHODS[method](),
                                            ignore_unknown_fields=True)
            last = getattr(request, "last", 0)
            if method == "GetMetrics" and last:
                del message.steps[:-last]
            return message

        return answer

    def _watch(self, request, timeout=None):
        async def events():
            for e in self._doc.get("events", []):
                yield json_format.ParseDict(e, pb.Event(), ignore_unknown_fields=True)

        return events()


class SnapshotClient:
    """Stands where a ProxyClient would for a finished local run: `client.runs.GetRun(...)` etc."""

    def __init__(self, path: Path):
        self.path = path
        self.runs = _SnapshotRuns(json.loads(path.read_text()))
