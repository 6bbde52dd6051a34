"""Every redis-py client brigade opens, with timeouts that fit what the client does.

redis-py 8 defaults `socket_timeout` to 5 s, so a blocking read (XREADGROUP / XREAD BLOCK) that
waits 5 s or more raised TimeoutError on a healthy Redis. Here the socket timeout follows the use:
a client of short commands gets COMMAND_TIMEOUT_S (a Redis that answers no GET in that long is
stuck), a client that blocks gets the longest block it issues plus BLOCK_MARGIN_S. Connecting is
always short, and idle connections are pinged before reuse (a connection a NAT or a Redis restart
dropped fails the ping, not the caller's command).

TLS: a `rediss://` URL; `?ssl_ca_certs=/path/ca.pem` names the CA that signed Redis's certificate
(redis-py's own query parameter; the pipelining client in `brigade.resp` reads it too). Query
parameters of the URL override these defaults, as redis-py's `from_url` does.

Redis Cluster: `redis+cluster://host:port` (`rediss+cluster://` with TLS) names any one node (or a
cloud service's configuration endpoint); the clients discover the others and follow the slots. A
run's keys share one slot (`brigade.keys`), so every script and pipeline of a run goes to one node.
rq (the evaluator's jobs, sandboxed rewards) cannot use a cluster: `rq_client` refuses a cluster URL,
and those services take a single-node Redis of their own (BRIGADE_RQ_REDIS_URL).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 10.0
BLOCK_MARGIN_S = 10.0
HEALTH_CHECK_INTERVAL_S = 15
POOL_WAIT_S = 10.0  # a caller waits this long for a free connection of a full pool
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

AnyRedis = aioredis.Redis | RedisCluster


def raise_if_cancelled() -> None:
    """Raise CancelledError when this task has been asked to stop. redis-py wraps socket writes
    and connects in asyncio.wait_for, which on Python 3.11 returns the result and drops a cancel
    that arrives as the operation completes (fixed in 3.12); a loop of Redis calls that must end
    when its task is cancelled (a WatchRun stream whose client left) calls this each turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def is_cluster(url: str) -> bool:
    return urlparse(url).scheme in CLUSTER_SCHEMES


def redis_py_url(url: str) -> str:
    """The URL as redis-py reads it: a cluster URL's scheme without `+cluster`."""
    scheme = urlparse(url).scheme
    return CLUSTER_SCHEMES[scheme] + url[len(scheme):] if scheme in CLUSTER_SCHEMES else url


def client_options(block_s: float = 0.0) -> dict[str, Any]:
    """redis-py keyword arguments for a client whose longest blocking read is `block_s` (0: none)."""
    return {
        "socket_timeout": block_s + BLOCK_MARGIN_S if block_s > 0 else COMMAND_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


def sync_client(url: str, block_s: float = 0.0) -> redis.Redis | redis.RedisCluster:
    """A blocking redis-py client (tools, tests, benchmarks): a cluster client for a cluster URL."""
    if is_cluster(url):
        return redis.RedisCluster.from_url(redis_py_url(url), **client_options(block_s))
    return redis.Redis.from_url(url, **client_options(block_s))


def rq_client(url: str) -> redis.Redis:
    """The blocking client rq's queues use; ValueError for a cluster URL (rq keeps its keys in many
    slots and runs MULTI across them)."""
    if is_cluster(url):
        raise ValueError(f"rq cannot use Redis Cluster ({url}); give the evaluator and the rollout workers a "
                         "single-node Redis for their job queues with BRIGADE_RQ_REDIS_URL (--rq-redis-url)")
    return redis.Redis.from_url(url, **client_options())


def async_client(url: str, max_connections: int, block_s: float = 0.0) -> AnyRedis:
    """An asyncio client over its own pool of at most `max_connections` (per node, on a cluster); a
    caller of a full pool waits up to POOL_WAIT_S for a connection, then gets redis' ConnectionError."""
    if is_cluster(url):
        return BoundedCluster.from_url(redis_py_url(url), waiting_limit=max_connections, **client_options(block_s))
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                    **client_options(block_s))
    return aioredis.Redis(connection_pool=pool)


@contextlib.asynccontextmanager
async def _permit(semaphore: asyncio.Semaphore):
    try:
        async with asyncio.timeout(POOL_WAIT_S):
            await semaphore.acquire()
    except TimeoutError:
        raise redis.exceptions.ConnectionError(f"no Redis connection free after {POOL_WAIT_S:g} s") from None
    try:
        yield
    finally:
        semaphore.release()


class BoundedCluster(RedisCluster):
    """redis-py's cluster client, waiting for a connection as BlockingConnectionPool does: its own
    raises MaxConnectionsError at once when a node's pool is full. Commands and pipelines take
    permits of their own (a pipeline re-sends a redirected command as a command, so one kind never
    waits on the other), each at most `waiting_limit`, so a node's pool never needs more than twice that."""

    def __init__(self, *args: Any, waiting_limit: int = 100, **kwargs: Any):
        super().__init__(*args, max_connections=2 * waiting_limit, **kwargs)
        self._commands = asyncio.Semaphore(waiting_limit)
        self._pipelines = asyncio.Semaphore(waiting_limit)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with _permit(self._commands):
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise redis.exceptions.RedisClusterException("shard_hint is deprecated in cluster mode")
        return _BoundedPipeline(self, transaction)


class _BoundedPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with _permit(self.cluster_client._pipelines):
            return await super().execute(raise_on_error, allow_redirections)
