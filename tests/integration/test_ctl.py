"""`brigade ctl` against a real proxy: every command's table and --json, the one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from proxy_support import (
    PROXY_TOKEN,
    SyncClient,
    adapter_manifest,
    make_prompts,
    make_spec,
    manifest_for,
    new_run_id,
)
from typer.testing import CliRunner

from brigade import keys
from brigade.v1 import brigade_pb2 as pb
from brigade_cli.ctl import app, format_status
from brigade_harness.devservers import free_port

TOKEN = PROXY_TOKEN


@pytest.fixture(scope="module")
def run(token_proxy):
    """A run with something in every table."""
    c = SyncClient(token_proxy.target, TOKEN)
    md = c.metadata
    run = new_run_id("ctl")
    c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, staleness={"max_attempts": 1, "max_staleness": 5}),
                                         prompts=make_prompts(12)), metadata=md)
    leases = [c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=w, capacity_class="spot",
                                                          price_per_hour=0.25, engine="hf"), metadata=md).lease
              for w in ("worker-a", "worker-b", "worker-c")]
    c.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=leases[0].lease_id, worker_id="worker-a",
                                                  manifest=manifest_for(run, leases[0], "worker-a")), metadata=md)
    c.lease.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=leases[1].lease_id, worker_id="worker-b",
                                          reason=pb.FailLeaseRequest.ERROR, message="reward crashed"), metadata=md)
    pulled = c.learner.PullRollouts(pb.PullRolloutsRequest(run_id=run, learner_id="L", max_manifests=5), metadata=md)
    c.learner.AckRollouts(pb.AckRolloutsRequest(run_id=run, learner_id="L",
                                                delivery_ids=[r.delivery_id for r in pulled.rollouts],
                                                consumed_batch_ids=[leases[0].batch.batch_id], step=1,
                                                metrics_json='{"loss": 0.125, "reward_mean": 0.5, "note": "x"}'),
                          metadata=md)
    c.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=adapter_manifest(run, 1)), metadata=md)
    token_proxy.call(token_proxy.store.redis.hset(keys.RunKeys(run).evals, "1", '{"accuracy": 0.75}'))
    c.close()
    return run


def ctl(token_proxy, *args: str, token: str = TOKEN):
    result = CliRunner().invoke(app, [*args, "--proxy", token_proxy.target, "--token", token], catch_exceptions=False)
    return result


def test_status(token_proxy, run):
    out = ctl(token_proxy, "status", "--run", run)
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert run in text and "adapter version        1" in text and "learner step           1" in text
    assert "dead-lettered          1" in text and "consumed               1" in text
    assert "lookahead              5 (fixed by staleness.lookahead)" in text
    data = json.loads(ctl(token_proxy, "status", "--run", run, "--json").stdout)
    assert data["spec"]["run_id"] == run and data["latest_version"] == "1" and data["leased"] == "1"


def test_status_says_how_automatic_lookahead_chose():
    state = pb.RunState(spec=pb.RunSpec(run_id="r"), lookahead=2, generation_s=21.5, step_busy_s=18.25)
    assert "2 versions (auto: a batch takes 21.5 s to generate, the learner 18.2 s a step)" in \
        format_status(state)
    fresh = pb.RunState(spec=pb.RunSpec(run_id="r"), lookahead=1)
    assert "1 version (auto: times not measured yet)" in format_status(fresh)
    sync = pb.RunState(spec=pb.RunSpec(run_id="r", sync=True))
    assert "0 (sync" in format_status(sync)


def test_runs(token_proxy, run):
    out = ctl(token_proxy, "runs")
    assert out.exit_code == 0 and out.stdout.splitlines()[0].split()[:3] == ["RUN", "VERSION", "STEP"]
    assert any(line.startswith(run) for line in out.stdout.splitlines())
    assert run in [r["spec"]["run_id"] for r in json.loads(ctl(token_proxy, "runs", "--json").stdout)]


def test_leases(token_proxy, run):
    out = ctl(token_proxy, "leases", "--run", run)
    header, rule, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["LEASE", "BATCH", "WORKER", "VERSION"] and set(rule) <= {"-", " "}
    assert len(rows) == 1 and "worker-c" in rows[0] and "in " in rows[0]
    (lease,) = json.loads(ctl(token_proxy, "leases", "--run", run, "--json").stdout)
    assert lease["worker_id"] == "worker-c" and lease["attempt"] == 1


def test_workers(token_proxy, run):
    out = ctl(token_proxy, "workers", "--run", run)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["WORKER", "CLASS", "ENGINE", "$/H", "GRANTED", "COMPLETED", "LAST", "SEEN"]
    assert len(lines) == 5 and all("spot" in line and "ago" in line for line in lines[2:])
    workers = {w["worker_id"]: w for w in json.loads(ctl(token_proxy, "workers", "--run", run, "--json").stdout)}
    assert workers["worker-a"]["leases_completed"] == "1" and workers["worker-b"]["leases_granted"] == "1"


def test_adapters(token_proxy, run):
    out = ctl(token_proxy, "adapters", "--run", run)
    assert "accuracy=0.75" in out.stdout and keys.adapter_prefix(run, 1) in out.stdout
    (a,) = json.loads(ctl(token_proxy, "adapters", "--run", run, "--json").stdout)
    assert a["version"] == "1" and a["eval"] == {"accuracy": 0.75}


def test_deadletters(token_proxy, run):
    out = ctl(token_proxy, "deadletters", "--run", run)
    assert "reward crashed" in out.stdout and "worker-b" in out.stdout
    (d,) = json.loads(ctl(token_proxy, "deadletters", "--run", run, "--json").stdout)
    assert d["last_worker"] == "worker-b" and d["attempts"] == 1


def test_metrics(token_proxy, run, redis_url):
    import redis

    from brigade.keys import RunKeys

    # the evaluator's held-out score of a published version shows beside the learner's metrics
    r = redis.Redis.from_url(redis_url)
    version = int(r.get(RunKeys(run).adapter_latest))
    r.hsetnx(RunKeys(run).evals, str(version), json.dumps({"version": version, "reward_mean": 0.75}))
    stored = json.loads(r.hget(RunKeys(run).evals, str(version)))
    r.close()
    out = ctl(token_proxy, "metrics", "--run", run)
    header, _, row, _, eval_header, _, eval_row = out.stdout.splitlines()
    assert header.split() == ["STEP", "LOSS", "REWARD_MEAN"] and row.split() == ["1", "0.125", "0.5"]
    assert eval_header.split() == ["VERSION", "HELD-OUT", "EVALUATION"] and eval_row.split()[0] == str(version)
    assert json.loads(ctl(token_proxy, "metrics", "--run", run, "--json").stdout) == {
        "steps": [{"step": 1, "metrics": {"loss": 0.125, "reward_mean": 0.5, "note": "x"}}],
        "evals": [{"version": version, "eval": stored}]}


def test_empty_tables(token_proxy):
    c = SyncClient(token_proxy.target, TOKEN)
    run = new_run_id("ctl")
    c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(2)), metadata=c.metadata)
    c.close()
    for cmd, text in [("leases", "(no leases in flight)"), ("workers", "(no workers yet)"),
                      ("adapters", "(no adapters published yet)"), ("deadletters", "(no dead letters)"),
                      ("metrics", "(no metrics yet)")]:
        out = ctl(token_proxy, cmd, "--run", run)
        assert out.exit_code == 0 and out.stdout.strip() == text
        empty = {"steps": [], "evals": []} if cmd == "metrics" else []
        assert json.loads(ctl(token_proxy, cmd, "--run", run, "--json").stdout) == empty


def one_line_error(result) -> str:
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_errors_are_one_line(token_proxy, run):
    line = one_line_error(ctl(token_proxy, "status", "--run", "no-such-run"))
    assert line.startswith("brigade ctl: NOT_FOUND: no run 'no-such-run'") and run in line
    line = one_line_error(ctl(token_proxy, "status", "--run", run, token="wrong"))
    assert "refused the token" in line and "BRIGADE_TOKEN" in line
    for cmd in ("status", "runs", "leases", "workers", "adapters", "deadletters", "metrics", "watch"):
        run_flag = [] if cmd == "runs" else ["--run", "r"]
        result = CliRunner().invoke(app, [cmd, "--proxy", f"127.0.0.1:{free_port()}", *run_flag],
                                    catch_exceptions=False)
        line = one_line_error(result)
        assert line.startswith("brigade ctl: cannot reach the proxy at 127.0.0.1:") and "BRIGADE_PROXY" in line
    # a proxy but no run named, and no local run to default to: asked, not answered for run `demo`
    line = one_line_error(CliRunner().invoke(app, ["status", "--proxy", token_proxy.target], catch_exceptions=False))
    assert line.startswith("brigade ctl: which run?") and "--run" in line
    line = one_line_error(CliRunner().invoke(app, ["status", "--proxy", token_proxy.target, "--run", run, "--tls-ca", "/nonexistent/ca.pem"]))
    assert "/nonexistent/ca.pem" in line


def test_watch_tails_until_ctrl_c(token_proxy, run):
    env = dict(os.environ, BRIGADE_PROXY=token_proxy.target, BRIGADE_TOKEN=TOKEN, BRIGADE_RUN=run)
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "ctl", "watch", "--from-start", "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = [json.loads(proc.stdout.readline()) for _ in range(4)]
        assert [e["type"] for e in events[:2]] == ["RunCreated", "WorkerSeen"]
        c = SyncClient(token_proxy.target, TOKEN)  # a new event arrives while watching
        c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="late-worker"), metadata=c.metadata)
        c.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            e = json.loads(proc.stdout.readline())
            if e["attrs"].get("worker") == "late-worker":
                break
        else:
            raise AssertionError("the new event never came")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_table_format(token_proxy, run):
    env = dict(os.environ, BRIGADE_PROXY=token_proxy.target, BRIGADE_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "ctl", "watch", "--run", run, "--from-start"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert "RunCreated" in first and "prompts=12" in first, proc.stderr.read() if not first else first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_command_against_a_proxy_on_a_redis_cluster(redis_cluster_url, monkeypatch):
    """ctl talks gRPC only: the same commands work when the proxy's Redis is a cluster; `ctl runs`
    reads every page of ListRuns (two here, with pages of 2)."""
    from proxy_support import BackgroundProxy

    import brigade_cli.ctl

    proxy = BackgroundProxy(redis_cluster_url, token=TOKEN)
    try:
        c = SyncClient(proxy.target, TOKEN)
        runs = sorted(new_run_id("ctlc") for _ in range(3))
        for r in runs:
            c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(r), prompts=make_prompts(4)), metadata=c.metadata)
        c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=runs[0], worker_id="wc"), metadata=c.metadata)
        c.close()
        monkeypatch.setattr(brigade_cli.ctl, "RUNS_PAGE", 2)
        listed = [r["spec"]["run_id"] for r in json.loads(ctl(proxy, "runs", "--json").stdout)]
        assert set(runs) <= set(listed) and listed == sorted(listed)
        assert [x["worker_id"] for x in json.loads(ctl(proxy, "leases", "--run", runs[0], "--json").stdout)] == ["wc"]
        for cmd in ("status", "workers", "adapters", "deadletters", "metrics"):
            out = ctl(proxy, cmd, "--run", runs[0], "--json")
            assert out.exit_code == 0, (cmd, out.output)
    finally:
        proxy.close()
