"""The small decisions of `brigade up` and `ctl`: progress rate, summaries of failed runs, plot
limits, run ids, local-run discovery and the cause shown for a stalled run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from brigade.spec import RUN_ID_RE
from brigade_cli.local_runs import ENDPOINT, SNAPSHOT, find_local_run, write_endpoint
from brigade_cli.plots import robust_top
from brigade_cli.up import default_run_id, recent_rate, summarize
from brigade_harness.system import Service


def test_samples_per_second_is_the_recent_rate_not_the_average_since_launch():
    # 10 slow steps (1 sample/s), then 10 fast ones (10 samples/s)
    metrics, t = [], 0.0
    for i in range(20):
        t += 10.0 if i < 10 else 1.0
        metrics.append({"step": i + 1, "time_unix": t, "accepted_samples": 10})
    assert abs(recent_rate(metrics, window_s=5.0) - 10.0) < 1e-9
    assert recent_rate(metrics[:1]) == 0.0


def test_a_run_without_steps_reports_no_reward_rather_than_zero():
    s = summarize("r", [], None, 3.0, "failed", [])
    assert s["first20_reward"] is None and s["last20_reward"] is None and s["heldout_last"] is None
    s = summarize("r", [{"reward_mean": 0.5}, {"reward_mean": 1.0}], None, 3.0, "finished",
                  [(1, {"reward_mean": 0.25}), (2, {"reward_mean": 0.75})])
    assert s["first20_reward"] == 0.75 and (s["heldout_first"], s["heldout_last"]) == (0.25, 0.75)


def test_two_spikes_do_not_set_the_plot_scale():
    values = [0.01] * 50 + [5.0, 7.0]
    top = robust_top(values)
    assert top is not None and top < 1.0
    assert robust_top([0.01 * i for i in range(50)]) is None  # no spike: matplotlib's own limits


def test_a_spec_without_run_id_gets_a_valid_one_per_launch():
    rid = default_run_id("/some/where/My Task.v2.yaml")
    assert rid.startswith("my-task.v2-") and RUN_ID_RE.match(rid)


def test_local_runs_live_then_ended(tmp_path):
    runs = tmp_path / "brigade-runs"
    (runs / "old").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (runs / "old" / ENDPOINT).write_text(json.dumps({"run": "old", "proxy": "127.0.0.1:1", "pid": int(dead.stdout)}))
    (runs / "new").mkdir()
    write_endpoint(runs / "new", "new", "127.0.0.1:2")  # this process: alive
    os.utime(runs / "old" / ENDPOINT, (1, 1))
    latest = find_local_run(runs_dir=runs)
    assert latest.run == "new" and latest.live and latest.proxy == "127.0.0.1:2"
    old = find_local_run("old", runs_dir=runs)
    assert not old.live and old.snapshot is None
    (runs / "new" / SNAPSHOT).write_text("{}")  # `up` wrote its snapshot: the run has ended
    assert not find_local_run("new", runs_dir=runs).live
    assert find_local_run("absent", runs_dir=runs) is None


def test_the_cause_of_a_stall_is_the_newest_distinct_warnings(tmp_path):
    log = tmp_path / "rollout-0.log"
    lines = [{"event": "batch_done", "level": "info"},
             {"event": "reward function failed", "level": "warning", "error": "RuntimeError: old"},
             {"event": "no sample of the batch was scored", "level": "warning", "batch": "r:0:1"},
             {"event": "reward function failed", "level": "warning", "error": "RuntimeError: newest"}]
    log.write_text("\n".join(json.dumps(d) for d in lines) + "\nnot json\nValueError: from a traceback\n")
    svc = Service("rollout-0", "m", [], log, {})
    problems = svc.last_problems(n=2)
    assert problems == ["reward function failed: error=RuntimeError: newest", "ValueError: from a traceback"]


def test_live_line_has_step_of_max_eta_and_the_held_out_score(capsys):
    from brigade_cli.live import Progress, clock, eta_s, live_text

    metrics = [{"step": s, "time_unix": 100.0 + 2 * s, "reward_mean": 0.5, "staleness_mean": 1.0,
                "rejection_rate": 0.1} for s in range(1, 11)]
    assert eta_s(metrics, 40) == 60.0  # 30 steps to go at 2 s a step
    assert eta_s(metrics, 0) is None and eta_s(metrics[:1], 40) is None
    assert clock(60.0) == "01:00" and clock(3725) == "1:02:05" and clock(None) == "--:--"
    text = live_text(metrics[-1], 40, 3, 0.625, 60.0)
    for part in ("step 10/40", "ETA 01:00", "reward 0.500", "held-out 0.625", "staleness 1.00", "rejected 10.0%",
                 "workers 3"):
        assert part in text, (part, text)
    # not a terminal: the plain lines, one per new step, as before
    p = Progress(40, lambda m, *a: f"plain {m['step']}", lambda ms: 0.0, tty=False)
    p.show(metrics, 8, 3, None)
    p.close()
    assert capsys.readouterr().out.splitlines() == ["plain 9", "plain 10"]


def test_live_line_on_a_terminal_redraws_in_place(capsys):
    from brigade_cli.live import Progress

    p = Progress(5, lambda *a: "plain", lambda ms: 0.0, tty=True)
    p.show([{"step": 2, "time_unix": 1.0}], 0, 1, None)
    p.close()
    out = capsys.readouterr().out
    assert "step 2/5" in out and "plain" not in out


def test_a_sigterm_during_the_progress_poll_is_not_swallowed():
    """`up` polls the proxy inside `asyncio.run`, guarded by a best-effort `except Exception`; a SIGTERM
    landing there must still reach the ordered stop (it once became "progress unavailable: Stopped"
    and the run trained on to its end, exit 0)."""
    import asyncio
    import signal

    from brigade_cli.up import Stopped, _raise_stopped

    async def poll():
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(5)

    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        with pytest.raises(Stopped) as stopped:
            try:
                asyncio.run(poll())
            except Exception:  # what up's loop does with a failed poll
                raise AssertionError("the SIGTERM was swallowed as a failed poll") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.signum == signal.SIGTERM


def test_up_gives_the_cores_to_the_side_computing():
    from brigade.v1 import brigade_pb2 as pb
    from brigade_cli.up import torch_threads

    # sync: the workers generate, then the learner trains; each side gets the cores in its turn
    assert torch_threads(pb.RunSpec(sync=True), workers=1, cores=2) == (2, 2)
    assert torch_threads(pb.RunSpec(sync=True), workers=2, cores=2) == (2, 1)
    assert torch_threads(pb.RunSpec(sync=True), workers=3, cores=2) == (2, 1)
    # async: a worker keeps one thread; the learner takes the rest and the core a waiting worker leaves
    assert torch_threads(pb.RunSpec(sync=False), workers=1, cores=2) == (2, 1)
    assert torch_threads(pb.RunSpec(sync=False), workers=2, cores=2) == (1, 1)
    assert torch_threads(pb.RunSpec(sync=False), workers=3, cores=8) == (6, 1)


def test_torch_threads_reach_the_thread_a_service_computes_on():
    """The learner trains on a pool thread and the worker generates on one: the setting, applied
    on the main thread after the fork, must hold there (a fresh child, as a forked service is)."""
    code = ("import threading, torch; from brigade.service import use_torch_threads; use_torch_threads(2); "
            "out = []; t = threading.Thread(target=lambda: out.append(torch.get_num_threads())); t.start(); "
            "t.join(); print(out[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    assert out.strip() == "2"


def test_threads_override_takes_two_counts_or_nothing():
    import typer

    from brigade_cli.up import threads_override

    assert threads_override("") is None and threads_override("2,1") == (2, 1)
    for bad in ("2", "2,x", "0,1", "1,2,3"):
        with pytest.raises(typer.BadParameter, match="--threads"):
            threads_override(bad)


def test_the_final_line_scores_the_final_version_whatever_step_published_it(tmp_path):
    """`up` polls evaluations as (learner step, evaluation); with publish_every 2, version 3 is
    step 6: the line must find v3's score by the evaluation's version, not by the step."""
    from types import SimpleNamespace

    from brigade.spec_file import build_spec
    from brigade_cli.finish import final_adapter_line

    spec = build_spec({"run_id": "fin", "publish_every": 2, "max_steps": 6})
    evals = [(2, {"version": 1, "reward_mean": 0.9}), (6, {"version": 3, "reward_mean": 0.5})]
    line = final_adapter_line(spec, SimpleNamespace(latest_version=3), evals, f"file://{tmp_path}/bucket")
    assert "final adapter: v3, held-out 0.500" in line and "(--best: v1, 0.900)" in line, line
