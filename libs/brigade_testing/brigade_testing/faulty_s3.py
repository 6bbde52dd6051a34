"""A fault-injecting HTTP reverse proxy for an S3 API (moto in the tests): the services point
AWS_ENDPOINT_URL at it, it forwards every request to the real server and, at a set rate, breaks
some of them the ways a real network and a real object store do:

    error         a 500/503 S3 error, the request never reaches the store
    lost_answer   the request reaches the store (a write lands), then the answer is a 500
    stall         nothing for `stall_s` seconds, then the connection closes (a middlebox timeout)
    drop          the connection closes without an answer, before or after the store saw it
    truncate      the answer's headers promise N bytes, the connection closes after N/2

and, separately, `corrupt_rate` flips one byte in the body of GETs whose path matches
`corrupt_match` (rollout objects by default), keeping the length: only a sha256 check catches it;
`drop_headers` removes request headers before forwarding (`("if-none-match",)` makes a store that
ignores create-only writes; moto checks no signatures, so the request still goes through).

Every decision is counted in `stats` (and the keys corrupted are listed), so a test can prove the
faults really happened. Runs in its own thread (`start_in_thread`) or as a process:

    python -m brigade_testing.faulty_s3 --upstream http://127.0.0.1:PORT --port 0 --rate 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

KINDS = ("error", "lost_answer", "stall", "drop", "truncate")
_MAX_HEADER_BYTES = 64 * 1024


@dataclass
class Faults:
    """What to break. Mutable while the proxy runs (plain attribute writes; the proxy reads them
    per request)."""

    rate: float = 0.0                        # probability that a request gets one fault of `kinds`
    kinds: tuple[str, ...] = KINDS
    corrupt_rate: float = 0.0                # probability that a matching GET body is corrupted
    corrupt_match: str = "/rollouts/"        # ... path substring
    corrupt_suffix: str = ".safetensors"     # ... and ending
    max_corrupt: int | None = None           # stop corrupting after this many
    stall_s: float = 2.0
    only_methods: tuple[str, ...] = ()       # faults only for these methods (empty: all)
    only_match: str = ""                     # faults only for paths containing this (empty: all)
    skip: Callable[[str, str], bool] | None = None  # (method, path) -> True: no fault for this request
    seed: int | None = None
    force: list[str] = field(default_factory=list)  # the next requests get these faults, in order
    drop_headers: tuple[str, ...] = ()       # request headers (lower case) never forwarded

    def __post_init__(self) -> None:
        unknown = (set(self.kinds) | set(self.force)) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {KINDS}")


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)


@dataclass
class _Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class _Closed(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise _Closed() from e
    except asyncio.LimitOverrunError as e:
        raise _Closed() from e
    if len(head) > _MAX_HEADER_BYTES:
        raise _Closed()
    return head


def _parse_headers(lines: list[str]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        if not line:
            continue
        k, _, v = line.partition(":")
        out.append((k.strip(), v.strip()))
    return out


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            # trailers until an empty line
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request:
    head = (await _read_head(reader)).decode("latin-1")
    lines = head.split("\r\n")
    try:
        method, target, version = lines[0].split(" ", 2)
    except ValueError as e:
        raise _Closed() from e
    headers = _parse_headers(lines[1:])
    req = _Request(method, target, version, headers, b"")
    if (req.header("expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    try:
        if (req.header("transfer-encoding") or "").lower() == "chunked":
            req.body = await _read_chunked(reader)
        elif (n := int(req.header("content-length") or 0)) > 0:
            req.body = await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ValueError) as e:
        raise _Closed() from e
    return req


class FaultyS3:
    """The proxy. `await start()` binds 127.0.0.1:`port` (0 = any free port)."""

    def __init__(self, upstream: str, faults: Faults | None = None, port: int = 0):
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.faults = faults or Faults()
        self.port = port
        self.stats: Counter = Counter()
        self.corrupted: list[str] = []        # paths of the GET bodies corrupted, in order
        self._rng = random.Random(self.faults.seed)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, limit=_MAX_HEADER_BYTES * 2)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()

    # ------------------------------------------------------------ per connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            while True:
                req = await _read_request(reader, writer)
                if not await self._handle(req, writer):
                    break
        except (_Closed, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _pick_fault(self, req: _Request) -> str | None:
        f = self.faults
        if f.only_methods and req.method not in f.only_methods:
            return None
        if f.only_match and f.only_match not in req.path:
            return None
        if f.skip is not None and f.skip(req.method, req.path):
            return None
        if f.force:
            return f.force.pop(0)
        if f.rate <= 0 or not f.kinds:
            return None
        if self._rng.random() >= f.rate:
            return None
        return self._rng.choice(list(f.kinds))

    def _should_corrupt(self, req: _Request, resp: _Response) -> bool:
        f = self.faults
        if f.corrupt_rate <= 0 or req.method != "GET" or resp.status != 200 or len(resp.body) == 0:
            return False
        if f.corrupt_match not in req.path or not req.path.endswith(f.corrupt_suffix):
            return False
        if f.max_corrupt is not None and len(self.corrupted) >= f.max_corrupt:
            return False
        return self._rng.random() < f.corrupt_rate

    async def _handle(self, req: _Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        self.stats["requests"] += 1
        fault = self._pick_fault(req)
        if fault is not None:
            self.stats[fault] += 1
        if fault == "error":
            await self._send(writer, _error_response(self._rng.choice((500, 503))), req)
            return True
        if fault == "stall":
            await asyncio.sleep(self.faults.stall_s)
            return False
        if fault == "drop" and self._rng.random() < 0.5:
            return False                          # never reached the store
        resp = await self._forward(req)
        if fault == "drop":
            return False                          # reached the store, answer lost
        if fault == "lost_answer":
            await self._send(writer, _error_response(500), req)
            return True
        if fault == "truncate" and req.method != "HEAD" and len(resp.body) > 1:
            await self._send(writer, resp, req, cut=len(resp.body) // 2)
            return False
        if fault == "truncate":
            self.stats["truncate_skipped"] += 1   # nothing to cut: answered normally
        if self._should_corrupt(req, resp):
            body = bytearray(resp.body)
            i = self._rng.randrange(len(body))
            body[i] ^= 0xFF
            resp.body = bytes(body)
            self.corrupted.append(req.path)
            self.stats["corrupt"] += 1
        await self._send(writer, resp, req)
        return True

    async def _forward(self, req: _Request) -> _Response:
        reader, writer = await asyncio.open_connection(self.upstream_host, self.upstream_port, limit=1 << 20)
        try:
            skip = {"connection", "expect", "transfer-encoding", "content-length", "keep-alive",
                    *self.faults.drop_headers}
            lines = [f"{req.method} {req.target} HTTP/1.1"]
            lines += [f"{k}: {v}" for k, v in req.headers if k.lower() not in skip]
            lines += [f"Content-Length: {len(req.body)}", "Connection: close", "", ""]
            writer.write("\r\n".join(lines).encode("latin-1") + req.body)
            await writer.drain()
            head = (await _read_head(reader)).decode("latin-1").split("\r\n")
            _, status, *reason = head[0].split(" ", 2)
            headers = _parse_headers(head[1:])
            hmap = {k.lower(): v for k, v in headers}
            if req.method == "HEAD" or int(status) in (204, 304) or 100 <= int(status) < 200:
                body = b""
            elif hmap.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_chunked(reader)
            elif "content-length" in hmap:
                body = await reader.readexactly(int(hmap["content-length"]))
            else:
                body = await reader.read()
            return _Response(int(status), reason[0] if reason else "", headers, body)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, resp: _Response, req: _Request, cut: int | None = None) -> None:
        skip = {"connection", "transfer-encoding", "keep-alive"}
        if req.method != "HEAD":
            skip.add("content-length")
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
        lines += [f"{k}: {v}" for k, v in resp.headers if k.lower() not in skip]
        if req.method != "HEAD":
            lines.append(f"Content-Length: {len(resp.body)}")
        lines += ["Connection: keep-alive", "", ""]
        body = resp.body if cut is None or req.method == "HEAD" else resp.body[:cut]
        writer.write("\r\n".join(lines).encode("latin-1") + body)
        await writer.drain()


def _error_response(status: int) -> _Response:
    code, message = {500: ("InternalError", "We encountered an internal error. Please try again."),
                     503: ("SlowDown", "Please reduce your request rate.")}[status]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>faulty-s3</RequestId></Error>").encode()
    reason = "Internal Server Error" if status == 500 else "Service Unavailable"
    return _Response(status, reason, [("Content-Type", "application/xml")], body)


# ---------------------------------------------------------------- in a thread


@dataclass
class ThreadedFaultyS3:
    """A FaultyS3 on its own event loop and thread; `faults` and `stats` are live."""

    proxy: FaultyS3
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    _stopped: bool = field(default=False)

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def faults(self) -> Faults:
        return self.proxy.faults

    @property
    def stats(self) -> Counter:
        return self.proxy.stats

    @property
    def corrupted(self) -> list[str]:
        return self.proxy.corrupted

    def call(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def start_in_thread(upstream: str, faults: Faults | None = None, port: int = 0) -> ThreadedFaultyS3:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="faulty-s3", daemon=True)
    thread.start()
    proxy = FaultyS3(upstream, faults, port)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    return ThreadedFaultyS3(proxy, loop, thread)


# ---------------------------------------------------------------- as a process


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="the real S3 endpoint, e.g. http://127.0.0.1:9000")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.05)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--corrupt-rate", type=float, default=0.0)
    p.add_argument("--stall-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()

    async def run() -> None:
        proxy = FaultyS3(a.upstream, Faults(rate=a.rate, kinds=tuple(k for k in a.kinds.split(",") if k),
                                            corrupt_rate=a.corrupt_rate, stall_s=a.stall_s, seed=a.seed), a.port)
        await proxy.start()
        print(proxy.url, flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()
            print(dict(proxy.stats), flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
