"""A minimal pipelining Redis client for the proxy's hot path (EVALSHA of the lease scripts).

redis-py spends ~100 us of Python per command (connection pool, retry wrapper, encoder, parser);
at a thousand lease cycles a second that is a fifth of a core. This client keeps one connection,
writes every command issued during one event-loop turn in a single send (automatic pipelining),
and parses RESP2 replies (hiredis's C reader) straight into futures, in order. Replies are what
redis-py returns with decode_responses=False: bytes, int, None, lists; an error reply raises `ReplyError`.

Only what the hot path needs: TCP `redis://` and `rediss://` (TLS) URLs with optional password and
database; for TLS, `?ssl_ca_certs=` (the CA file) and `?ssl_check_hostname=` as redis-py reads them.
Anything else (unix sockets, other query parameters) makes `supports()` false and the caller stays
on redis-py.

Redis Cluster (`redis+cluster://`, `rediss+cluster://`): `ClusterPipelinedRedis` keeps one such
connection per master and sends each command to the master of its key's slot, from a slot map read
with CLUSTER SLOTS. A MOVED, ASK, TRYAGAIN or CLUSTERDOWN answer means the command did not run, so it
is sent again where the answer says (a MOVED also re-reads the map); a lost connection is raised to
the caller as it is on one node (a script may have run: only the caller knows whether to retry).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from urllib.parse import parse_qs, unquote, urlparse

import hiredis
import redis.exceptions
from redis.crc import key_slot

from brigade.redis_clients import CLUSTER_SCHEMES, is_cluster, redis_py_url


class ReplyError(redis.exceptions.ResponseError):
    """An error reply from Redis (e.g. NOSCRIPT, WRONGTYPE)."""


class OutOfMemory(ReplyError, redis.exceptions.OutOfMemoryError):
    """Redis refused a write: used memory is over `maxmemory` (what redis-py raises as OutOfMemoryError)."""


# the query parameters of a URL this client understands (redis-py's names)
TLS_PARAMETERS = frozenset({"ssl_ca_certs", "ssl_check_hostname"})


class Loading(ReplyError, redis.exceptions.BusyLoadingError):
    """Redis is loading its dataset after a restart and runs nothing until it is done (redis-py's
    BusyLoadingError, a ConnectionError: the command did not run, call again shortly)."""


# error replies that redis-py raises as a class of their own, by the reply's first word
_REPLY_ERRORS: dict[str, type[ReplyError]] = {"OOM": OutOfMemory, "LOADING": Loading}


def reply_error(message: str) -> ReplyError:
    return _REPLY_ERRORS.get(message.partition(" ")[0], ReplyError)(message)


def _encode(value: object) -> bytes:
    """An argument's bytes on the wire (redis-py's rules)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, int | float):
        return repr(value).encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"cannot send {type(value).__name__} to Redis")


def pack(args: tuple | list) -> bytes:
    """One command in RESP2, by hiredis's C packer (a lease script's 22 arguments: 4 us, 10 in Python)."""
    args = tuple(args)
    try:
        return hiredis.pack_command(args)
    except TypeError:  # a bool, a bytearray: what the C packer does not take
        return hiredis.pack_command(tuple(_encode(a) for a in args))


_MORE = object()  # hiredis's answer when the buffer holds no complete reply yet


class Replies:
    """RESP2 replies out of the bytes read so far, by hiredis's C reader (a script's reply: under a
    microsecond, 7 in Python): `feed` what arrived, then `next()` until it answers `_MORE`. An error reply
    comes back as a ReplyError (OutOfMemory, Loading: the classes redis-py raises for them), not raised;
    bytes that are not RESP raise hiredis.ProtocolError."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=ReplyError, notEnoughData=_MORE)

    def feed(self, data: bytes) -> None:
        self._reader.feed(data)

    def next(self) -> object:
        """The next whole reply, or _MORE."""
        value = self._reader.gets()
        if type(value) is ReplyError:
            return reply_error(str(value))
        return value


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.replies = Replies()
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.closed: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, data: bytes, fut: asyncio.Future) -> None:
        if self.closed is not None:
            raise redis.exceptions.ConnectionError(f"connection to Redis lost: {self.closed}")
        self.out.append(data)
        self.waiting.append(fut)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and self.closed is None:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        replies = self.replies
        try:
            replies.feed(data)
            while (value := replies.next()) is not _MORE:
                fut = self.waiting.popleft()
                if not fut.done():  # its caller may have been cancelled; the reply is dropped
                    if isinstance(value, ReplyError):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)
        except Exception as e:  # noqa: BLE001 - a protocol error: this connection is unusable
            self._fail(redis.exceptions.ConnectionError(f"bad reply from Redis: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis.exceptions.ConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, exc: Exception) -> None:
        self.closed = exc
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


def tls_context(scheme: str, query: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of a rediss:// URL (None for redis://): the system CAs, or `ssl_ca_certs`."""
    if scheme != "rediss":
        return None
    ctx = ssl.create_default_context(cafile=query.get("ssl_ca_certs") or None)
    ctx.check_hostname = query.get("ssl_check_hostname", "true").lower() not in ("0", "false", "no", "n", "f")
    return ctx


class PipelinedRedis:
    """One auto-pipelined connection, opened on first use and reopened after a failure. `host` and
    `port` override the URL's (a cluster's other nodes, with the URL's password and TLS)."""

    def __init__(self, url: str, connect_timeout: float = 5.0, *, host: str = "", port: int = 0):
        u = urlparse(redis_py_url(url))
        self.tls = tls_context(u.scheme, {k: v[-1] for k, v in parse_qs(u.query).items()})
        self.host = host or u.hostname or "127.0.0.1"
        self.port = port or u.port or 6379
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password else None
        path = (u.path or "/").strip("/")
        self.db = int(path) if path else 0
        self.connect_timeout = connect_timeout
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    @staticmethod
    def supports(url: str) -> bool:
        u = urlparse(url)
        if u.scheme not in ("redis", "rediss", *CLUSTER_SCHEMES) or not set(parse_qs(u.query)) <= TLS_PARAMETERS:
            return False
        path = (u.path or "/").strip("/")
        return path == "" or path.isdigit() and not (is_cluster(url) and int(path))

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.closed is None:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(_Protocol, self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls else None), self.connect_timeout)
        except (OSError, TimeoutError) as e:  # ssl.SSLError (a bad certificate) is an OSError
            raise redis.exceptions.ConnectionError(f"cannot connect to Redis at {self.host}:{self.port}: {e}") from e
        sock = proto.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self.password is not None:
            auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            await self._send(proto, auth)
        if self.db:
            await self._send(proto, ("SELECT", self.db))
        self._proto = proto
        return proto

    @staticmethod
    def _send(proto: _Protocol, args: tuple | list) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        proto.send(pack(args), fut)
        return fut

    async def execute(self, *args: object, key: object = None) -> object:
        """One command's reply. `key` routes a command on a cluster; one node ignores it."""
        proto = await self._connection()
        return await self._send(proto, args)

    async def execute_asking(self, *args: object) -> object:
        """ASKING, then the command, back to back on this connection (a slot being migrated here)."""
        proto = await self._connection()
        asking = self._send(proto, ("ASKING",))
        reply = self._send(proto, args)
        await asking
        return await reply

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()


MAX_REDIRECTS = 5     # MOVED / ASK / TRYAGAIN answers one command may get before it is an error


class ClusterPipelinedRedis:
    """PipelinedRedis for Redis Cluster: one auto-pipelined connection per master, each command sent
    to the master of its key's slot. Opened on first use."""

    def __init__(self, url: str, connect_timeout: float = 5.0):
        self.url, self.connect_timeout = url, connect_timeout
        seed = PipelinedRedis(url, connect_timeout)
        self._nodes: dict[tuple[str, int], PipelinedRedis] = {(seed.host, seed.port): seed}
        self._slots: list[tuple[str, int] | None] = [None] * 16384
        self._stale = True
        self._refreshing: asyncio.Future | None = None

    def _node(self, addr: tuple[str, int]) -> PipelinedRedis:
        node = self._nodes.get(addr)
        if node is None:
            node = self._nodes[addr] = PipelinedRedis(self.url, self.connect_timeout, host=addr[0], port=addr[1])
        return node

    async def _refresh(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from the first node that answers; concurrent callers share one read."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read_slots())
        try:
            await asyncio.shield(self._refreshing)
        finally:
            if self._refreshing is not None and self._refreshing.done():
                self._refreshing = None

    async def _read_slots(self) -> None:
        error: Exception | None = None
        for addr, node in list(self._nodes.items()):
            try:
                ranges = await node.execute("CLUSTER", "SLOTS")
            except (redis.exceptions.ConnectionError, ReplyError) as e:
                error = e
                continue
            for start, end, master, *_replicas in ranges:
                host = master[0].decode() or addr[0]  # '' = the node that answered
                for slot in range(start, end + 1):
                    self._slots[slot] = (host, int(master[1]))
            self._stale = False
            return
        raise redis.exceptions.ConnectionError(f"no node of the Redis Cluster at {self.url} answered: {error}")

    async def execute(self, *args: object, key: object = None) -> object:
        if key is None:
            raise ValueError(f"a command on Redis Cluster needs the key that routes it: {args[:1]}")
        slot = key_slot(_encode(key))
        for attempt in range(MAX_REDIRECTS):
            if self._stale or self._slots[slot] is None:
                await self._refresh()
            addr = self._slots[slot]
            if addr is None:
                raise redis.exceptions.ClusterDownError(f"CLUSTERDOWN slot {slot} is not served by any node")
            try:
                return await self._node(addr).execute(*args)
            except redis.exceptions.ConnectionError:
                self._stale = True  # a failover may have moved the slot: read the map before the next command
                raise
            except ReplyError as e:
                kind, _, where = str(e).partition(" ")
                if kind == "MOVED":
                    self._stale = True
                elif kind == "ASK":
                    host, _, port = where.split(" ")[1].rpartition(":")
                    return await self._node((host or addr[0], int(port))).execute_asking(*args)
                elif kind in ("TRYAGAIN", "CLUSTERDOWN"):
                    await asyncio.sleep(0.05 * 2**attempt)
                else:
                    raise
        raise redis.exceptions.ClusterError(f"command still redirected after {MAX_REDIRECTS} tries: {args[:1]}")

    async def close(self) -> None:
        for node in self._nodes.values():
            await node.close()


def pipelined_client(url: str) -> PipelinedRedis | ClusterPipelinedRedis | None:
    """The pipelining client for `url`, or None where only redis-py can go (PipelinedRedis.supports)."""
    if not PipelinedRedis.supports(url):
        return None
    return ClusterPipelinedRedis(url) if is_cluster(url) else PipelinedRedis(url)
