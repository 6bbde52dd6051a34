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
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 10.0
BLOCK_MARGIN_S = 10.0
HEALTH_CHECK_INTERVAL_S = 15
POOL_WAIT_S = 10.0  # a caller waits this long for a free connection of a full pool


def client_options(block_s: float = 0.0) -> dict[str, Any]:
    """redis-py keyword arguments for a client whose longest blocking read is `block_s` (0: none)."""
    return {
        "socket_timeout": block_s + BLOCK_MARGIN_S if block_s > 0 else COMMAND_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


def sync_client(url: str, block_s: float = 0.0) -> redis.Redis:
    """A blocking redis-py client (rq queues, the reward sandbox)."""
    return redis.Redis.from_url(url, **client_options(block_s))


def async_client(url: str, max_connections: int, block_s: float = 0.0) -> aioredis.Redis:
    """An asyncio client over its own pool of at most `max_connections`; a caller of a full pool
    waits up to POOL_WAIT_S for a connection, then gets redis' ConnectionError."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                    **client_options(block_s))
    return aioredis.Redis(connection_pool=pool)
