"""The create-only probe (brigade.bucket.probe): moto and a folder refuse a second create-only put, so
it passes; moto behind brigade_testing.faulty_s3 with `If-None-Match` dropped is a store that ignores the
header, and every service that writes create-only objects (the learner, a rollout worker, the proxy with
a bucket, the evaluator) refuses it at start with one line naming the store, and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from proxy_support import BackgroundProxy, SyncClient, make_prompts, make_spec, new_run_id

from brigade.bucket import CreateOnlyIgnored, check_create_only, open_bucket
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import free_port
from brigade_testing.faulty_s3 import Faults, start_in_thread

FIRST_PUT = b"brigade create-only probe: first put\n"


@pytest.fixture
def s3_front(s3_endpoint):
    """moto behind a forwarding proxy; set `faults.drop_headers` to make it ignore a header."""
    proxy = start_in_thread(s3_endpoint, Faults())
    yield proxy
    proxy.stop()


def service_env(endpoint: str) -> dict[str, str]:
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "BRIGADE_LOG_FORMAT": "console"}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    return env


def refusal_lines(output: str, endpoint: str) -> list[str]:
    return [line for line in output.splitlines() if "If-None-Match" in line and endpoint in line]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_probe_passes_where_create_only_is_honoured(s3_bucket_url, file_bucket_url, s3_front):
    for url, options in ((s3_bucket_url, {}), (file_bucket_url, {}), (s3_bucket_url, {"endpoint_url": s3_front.url})):
        async with open_bucket(url, **options) as bucket:
            key = await check_create_only(bucket, "probe-run")
            assert key.startswith("runs/probe-run/probe/")
            assert await bucket.get(key) == FIRST_PUT  # the refused second put changed nothing
    assert s3_front.stats["requests"] >= 2  # the last round really went through the forwarding proxy


@pytest.mark.asyncio(loop_scope="session")
async def test_the_probe_refuses_a_store_that_ignores_if_none_match(s3_bucket_url, s3_front):
    s3_front.faults.drop_headers = ("if-none-match",)
    async with open_bucket(s3_bucket_url, endpoint_url=s3_front.url) as bucket:
        with pytest.raises(CreateOnlyIgnored) as refused:
            await check_create_only(bucket, "probe-run")
    message = str(refused.value)
    assert "\n" not in message
    assert f"{s3_bucket_url} at {s3_front.url}" in message and "If-None-Match: *" in message


def test_the_learner_refuses_that_store_at_start(s3_bucket_url, s3_front):
    s3_front.faults.drop_headers = ("if-none-match",)
    out = subprocess.run(
        [sys.executable, "-m", "brigade_learner", "--proxy", "127.0.0.1:9", "--bucket", s3_bucket_url,
         "--run", "probe-run"],
        env=service_env(s3_front.url), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(refusal_lines(out.stdout + out.stderr, s3_front.url)) == 1, out.stderr[-3000:]


def test_the_rollout_worker_refuses_that_store_at_start(redis_url, s3_bucket_url, s3_front):
    proxy = BackgroundProxy(redis_url)
    client = SyncClient(proxy.target)
    try:
        run = new_run_id("probe")
        client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(4)))
        s3_front.faults.drop_headers = ("if-none-match",)
        out = subprocess.run(
            [sys.executable, "-m", "brigade_rollout", "--proxy", proxy.target, "--bucket", s3_bucket_url,
             "--run", run],
            env=service_env(s3_front.url), capture_output=True, text=True, timeout=120)
    finally:
        client.close()
        proxy.close()
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(refusal_lines(out.stdout + out.stderr, s3_front.url)) == 1, out.stderr[-3000:]


def test_the_proxy_refuses_that_store_at_start(redis_url, s3_bucket_url, s3_front):
    """One process, and --processes 2 (the parent probes once, before it starts any)."""
    s3_front.faults.drop_headers = ("if-none-match",)
    for processes in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-m", "brigade_cli.main", "proxy", "--listen", f"127.0.0.1:{free_port()}",
             "--redis-url", redis_url, "--bucket", s3_bucket_url, "--processes", processes],
            env=service_env(s3_front.url), capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-3000:]
        assert len(refusal_lines(out.stdout + out.stderr, s3_front.url)) == 1, out.stderr[-3000:]
        assert "proxy listening" not in out.stderr


def test_the_evaluator_refuses_that_store_at_start(redis_url, s3_bucket_url, s3_front):
    s3_front.faults.drop_headers = ("if-none-match",)
    out = subprocess.run(
        [sys.executable, "-m", "brigade_cli.main", "evaluator", "--redis-url", redis_url, "--bucket", s3_bucket_url,
         "--run", "probe-run"],
        env=service_env(s3_front.url), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(refusal_lines(out.stdout + out.stderr, s3_front.url)) == 1, out.stderr[-3000:]
