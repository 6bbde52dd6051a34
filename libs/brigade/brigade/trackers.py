"""Experiment trackers (the run spec's `report_to`): W&B, TensorBoard, trackio.

One tracker run per brigade run, named by the run id, with the run spec as its config. The learner
logs each committed step's metrics at step = its learner step; the evaluator logs its scores under
`eval/` at the step of the adapter it scored. A restarted learner reopens the same tracker run and
asks each tracker for the last step it holds, so a step replayed after a crash is not logged twice
and none goes missing: a step is logged only once committed, and a restart logs every committed
step a tracker lacks from the bucket's `metrics/` objects (a SIGKILL can take the last records a
tracker had not yet written, even of steps before the checkpoint it resumes from).

Each tracker is an optional extra (`pip install 'brigade[wandb]'`); a missing one is named with its
install hint once, at start, and the others still log.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import math
import os
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from brigade.metric_names import trl_metrics

log = structlog.get_logger()

CHOICES = ("wandb", "tensorboard", "trackio")
PROJECT = os.environ.get("BRIGADE_TRACKER_PROJECT", "brigade")
_MODULE = {"wandb": "wandb", "tensorboard": "tensorboard", "trackio": "trackio"}


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics dict (no `step`, no strings, no NaN): what every tracker plots."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class _Wandb:
    def __init__(self, run_id: str, config: dict, directory: str, role: str):
        import wandb

        os.makedirs(directory, exist_ok=True)
        self.dir = directory
        # the run id is the brigade run id and resume is allowed: a restarted learner continues the
        # run; the evaluator plots against its own step axis (W&B needs each axis to only grow)
        # the transaction log is flushed often (default: every 15 s): what a SIGKILL can lose is only
        # what arrived in the last fraction of a second, and a restart reads the rest back offline
        settings = wandb.Settings(x_transaction_log_flush_interval=0.2)
        if role == "evaluator" and os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled"):
            # a second writer of the learner's run: W&B's shared mode (offline, its own run folder
            # with the same id, which `wandb sync` merges)
            settings = wandb.Settings(mode="shared", x_primary=False, x_label="evaluator",
                                      x_update_finish_state=False)
        self.run = wandb.init(project=PROJECT, id=run_id, name=run_id, resume="allow", config=config, dir=directory,
                              job_type=role, reinit="create_new", settings=settings)
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.run_id = run_id

    def last_step(self) -> int:
        if not self.run.settings._offline:
            return max(self.run.step - 1, 0)  # online, the server's history is the truth
        # offline, every start is its own run folder (`wandb sync` merges them): read the earlier ones
        files = glob.glob(os.path.join(self.dir, "wandb", f"offline-run-*-{self.run_id}", f"run-{self.run_id}.wandb"))
        return max((max(wandb_offline_steps(p), default=0) for p in files), default=0)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step, commit=True)  # without commit W&B holds a step until the next

    def log_eval(self, values: dict[str, float], step: int) -> None:
        self.run.log({**{f"eval/{k}": v for k, v in values.items()}, "eval/step": step}, commit=True)

    def close(self) -> None:
        offline, path = self.run.settings._offline, self.run.settings.sync_file
        self.run.finish()
        if offline:
            # finish() returns before W&B's service has written the run's last records: wait for its
            # exit record, so a learner restarted at once (or a reader) sees every step logged
            deadline = time.monotonic() + 10
            while not wandb_offline_exited(path) and time.monotonic() < deadline:
                time.sleep(0.05)


class _TensorBoard:
    def __init__(self, run_id: str, config: dict, directory: str, role: str):
        from tensorboard.summary import Writer  # tensorboard's own writer: no torch, no tensorflow

        self.dir = os.path.join(directory, "tensorboard", run_id)
        self.last = tensorboard_last_step(self.dir)  # before this writer adds its (empty) file
        self.writer = Writer(self.dir)
        if role == "learner":  # tensorboard's writer has scalars only: the config goes beside the events
            with open(os.path.join(self.dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)

    def last_step(self) -> int:
        return self.last

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step=step)
        self.writer.flush()

    def log_eval(self, values: dict[str, float], step: int) -> None:
        self.log({f"eval/{k}": v for k, v in values.items()}, step)

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    def __init__(self, run_id: str, config: dict, directory: str, role: str):
        # trackio keeps its SQLite store under TRACKIO_DIR, read once at import: beside the other
        # trackers' files unless the user chose a place (`TRACKIO_DIR=... trackio show` reads it)
        os.environ.setdefault("TRACKIO_DIR", os.path.join(os.path.abspath(directory), "trackio"))
        import trackio

        with _quiet("trackio"):
            self.run = trackio.init(project=PROJECT, name=run_id, config=config, resume="allow",
                                    auto_log_cpu=False, auto_log_gpu=False)
        self.run_id = run_id

    def last_step(self) -> int:
        from trackio.sqlite_storage import SQLiteStorage

        logs = SQLiteStorage.get_logs(PROJECT, self.run_id) or []
        return max((int(e["step"]) for e in logs if not any(k.startswith("eval/") for k in e)), default=0)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)
        self._flush()

    def log_eval(self, values: dict[str, float], step: int) -> None:
        self.run.log({f"eval/{k}": v for k, v in values.items()}, step=step)
        self._flush()

    def _flush(self) -> None:
        # trackio writes its SQLite store from a thread every 0.5 s: a step committed just before
        # a SIGKILL would be lost, so write it now (trackio has no public flush)
        flush, lock = getattr(self.run, "_flush_queues_inline", None), getattr(self.run, "_client_lock", None)
        if flush is not None and lock is not None:
            with lock:
                flush()

    def close(self) -> None:
        with _quiet("trackio"):
            self.run.finish()


@contextlib.contextmanager
def _quiet(name: str):
    """trackio prints its banners to stdout: one log line instead, so JSON logs stay JSON."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        yield
    if text := out.getvalue().strip():
        log.debug("tracker_output", tracker=name, output=text[:2000])


_BACKENDS = {"wandb": _Wandb, "tensorboard": _TensorBoard, "trackio": _Trackio}


class Trackers:
    """The trackers a run reports to; `log_step` skips steps a tracker already holds."""

    def __init__(self, backends: dict[str, Any]):
        self.backends = backends
        self.last = {name: b.last_step() for name, b in backends.items()}
        if any(self.last.values()):
            log.info("trackers_resumed", last_logged_step=self.last)

    def oldest_step(self) -> int:
        """The newest step every tracker holds (-1: no tracker): a restart backfills the committed
        steps after it."""
        return min(self.last.values(), default=-1)

    def log_steps(self, metrics: Iterable[Mapping[str, Any]]) -> None:
        """The learner's step metrics, under TRL's names (brigade.metric_names)."""
        for m in metrics:
            step = int(m["step"])
            for name, b in self.backends.items():
                if step > self.last[name]:
                    b.log(scalars(trl_metrics(m)), step)
                    self.last[name] = step

    def log_eval(self, scores: Mapping[str, Any], step: int) -> None:
        flat = {**scores, **{f"reward/{k}": v for k, v in (scores.get("per_function") or {}).items()}}
        for b in self.backends.values():
            b.log_eval(scalars(flat), step)

    def close(self) -> None:
        for name, b in self.backends.items():
            try:
                b.close()
            except Exception as e:  # a tracker's upload failing must not fail the run's exit
                log.warning("tracker_close_failed", tracker=name, error=str(e)[:300])


def parse_report_to(flag: str) -> list[str] | None:
    """`--report-to`: "" = the run spec's (None), "none" = no tracker, else a comma-separated list."""
    if not flag:
        return None
    names = [n.strip() for n in flag.split(",") if n.strip() and n.strip() != "none"]
    if bad := [n for n in names if n not in CHOICES]:
        raise ValueError(f"{bad[0]!r} is not one of {', '.join(CHOICES)} (or none)")
    return names


def install_hint(name: str) -> str:
    return f"{name} is not installed: pip install 'brigade[{name}]'"


def open_trackers(names: Iterable[str], run_id: str, config: dict, directory: str, role: str = "learner") -> Trackers:
    """Open each named tracker that is installed; one warning line with the install hint per missing one."""
    backends = {}
    for name in dict.fromkeys(names):
        if importlib.util.find_spec(_MODULE[name]) is None:
            log.warning("tracker_missing", tracker=name, hint=install_hint(name))
            continue
        backends[name] = _BACKENDS[name](run_id, config, directory, role)
    if backends:
        log.info("trackers_open", trackers=sorted(backends), run=run_id, dir=directory)
    return Trackers(backends)


def tensorboard_last_step(directory: str) -> int:
    """The newest step of any non-eval scalar in a TensorBoard log folder (0 if none)."""
    if not os.path.isdir(directory):
        return 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    steps = [e.step for t in tags.get("tensors", []) if not t.startswith("eval/") for e in acc.Tensors(t)]
    steps += [e.step for t in tags.get("scalars", []) if not t.startswith("eval/") for e in acc.Scalars(t)]
    return max(steps, default=0)


def wandb_offline_steps(path: str) -> list[int]:
    """The history steps of one W&B offline run file (`run-ID.wandb`), in order."""
    steps = []
    for record in _wandb_records(path):
        items = record.history.item if record.WhichOneof("record_type") == "history" else []
        # the learner's steps, not the evaluator's (its own axis, `eval/step`) nor W&B's `_runtime`
        if any(not k.startswith(("eval/", "_")) for k in (i.key or "/".join(i.nested_key) for i in items)):
            steps.append(record.history.step.num)
    return steps


def wandb_offline_exited(path: str) -> bool:
    """Whether an offline run file holds its exit record (W&B wrote everything it was given)."""
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path))
    except OSError:
        return False


def _wandb_records(path: str):
    """The `Record` protobufs of a W&B run file: LevelDB's log format (32 KiB blocks of crc, length,
    type-tagged chunks); a torn tail (a killed process) ends the records."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    pos, block, chunk = 7, 32768, b""  # 7: the ":W&B" header
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(chunk)
            except Exception:  # the torn tail of a killed process
                return
            chunk = b""
            yield record
