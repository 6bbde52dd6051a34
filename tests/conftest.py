"""Shared fixtures: a real redis-server, a real three-master Redis Cluster and a real S3 HTTP API
(moto server mode), each on free ports, started once per test session (the cluster only when a
test asks for it). The machine's own Redis on 6379 is never touched."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest

from brigade_harness.devservers import MOTO_ENV, start_moto, start_redis, start_redis_cluster

# the tests' own reward functions live in test modules (test_trl_rewards:..., test_rollout_worker:...),
# and one test names a package that does not exist to see the import error: this host (the test
# session, and the services it starts, which inherit the variable) allows them; see brigade.code_policy
os.environ["BRIGADE_ALLOW_CODE"] = ",".join(filter(None, (os.environ.get("BRIGADE_ALLOW_CODE"), "test_*",
                                                          "no_such_pkg")))
# ... and the tiny models and datasets the tests write under the temporary folder
os.environ["BRIGADE_ALLOW_PATHS"] = ",".join(filter(None, (os.environ.get("BRIGADE_ALLOW_PATHS"),
                                                           tempfile.gettempdir())))


def pytest_collection_modifyitems(items):
    """`make test` runs on two processes (pytest-xdist, --dist loadgroup). The system tests each start
    a whole run (a dozen processes, timing-sensitive leases): they go to one process, one after the
    other, while the other takes the unit and integration tests."""
    for item in items:
        if item.path.parent.name == "system":
            item.add_marker(pytest.mark.xdist_group("system"))


@pytest.fixture(scope="session", autouse=True)
def session_state_dir(tmp_path_factory):
    """The services' crash journals (BRIGADE_STATE_DIR, brigade.crash_loop) in a folder of this session:
    the crashes tests cause never reach ~/.local/state/brigade, where they would stop real services."""
    old = os.environ.get("BRIGADE_STATE_DIR")
    path = tmp_path_factory.mktemp("state")
    os.environ["BRIGADE_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("BRIGADE_STATE_DIR", None)
    else:
        os.environ["BRIGADE_STATE_DIR"] = old


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"), appendonly=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """Three cluster-enabled redis-servers joined by `redis-cli --cluster create` (about a second)."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster) -> str:
    return redis_cluster.url


@pytest.fixture(scope="session", params=["single", "cluster"])
def any_redis_url(request) -> str:
    """A test that takes this runs twice: against the single redis-server and against the cluster."""
    return request.getfixturevalue("redis_url" if request.param == "single" else "redis_cluster_url")


@pytest.fixture(scope="session")
def s3_server():
    server = start_moto()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server):
    old = {k: os.environ.get(k) for k in [*MOTO_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(MOTO_ENV)
    os.environ["AWS_ENDPOINT_URL"] = s3_server.url
    yield s3_server.url
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket_url(s3_endpoint) -> str:
    """A fresh s3:// URL (new bucket name) per test; the bucket is created on first use."""
    return f"s3://brigade-test-{uuid.uuid4().hex[:12]}/runs-root"


@pytest.fixture
def file_bucket_url(tmp_path) -> str:
    return f"file://{tmp_path / 'bucket'}"


@pytest.fixture
def one_torch_thread():
    """Tiny models on a busy 2-core machine: a second OpenMP thread only adds spin-waiting
    (measured 10-100x slower), so torch-heavy tests pin one thread and restore it after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def token_proxy(redis_url):
    """A real proxy (grpc.aio, in a background thread) that demands proxy_support.PROXY_TOKEN."""
    from proxy_support import PROXY_TOKEN, BackgroundProxy

    proxy = BackgroundProxy(redis_url, token=PROXY_TOKEN)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def proxy_client(token_proxy):
    """A blocking client of token_proxy that sends the token."""
    from proxy_support import PROXY_TOKEN, SyncClient

    c = SyncClient(token_proxy.target, PROXY_TOKEN)
    yield c
    c.close()
