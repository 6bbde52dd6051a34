"""brigade.resp: the pipelined hot-path Redis connection (RESP2 parsing, pipelining, failures)."""

from __future__ import annotations

import asyncio

import hiredis
import pytest
import redis.exceptions
from hypothesis import given
from hypothesis import strategies as st

from brigade.resp import _MORE, PipelinedRedis, Replies, ReplyError, pack
from brigade_harness.devservers import start_redis

aio = pytest.mark.asyncio(loop_scope="session")

resp_values = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5),
    max_leaves=20,
)


def encode(value) -> bytes:
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    return b"*%d\r\n" % len(value) + b"".join(encode(v) for v in value)


def replies_of(*pieces: bytes) -> list:
    """Every whole reply after feeding `pieces` one by one."""
    r, out = Replies(), []
    for piece in pieces:
        r.feed(piece)
        while (value := r.next()) is not _MORE:
            out.append(value)
    return out


@given(resp_values)
def test_replies_roundtrip_and_every_split(value):
    data = encode(value) + b"+OK\r\n"
    assert replies_of(data) == [value, b"OK"]
    for cut in range(1, len(data) - 5):  # the first reply cut anywhere: nothing until the rest comes
        assert replies_of(data[:cut]) == []
        assert replies_of(data[:cut], data[cut:]) == [value, b"OK"]


def test_error_replies_and_pack():
    (err,) = replies_of(b"-NOSCRIPT No matching script\r\n")
    assert isinstance(err, ReplyError) and str(err).startswith("NOSCRIPT")
    assert pack(["SET", "k", 5, b"\x00v"]) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n$2\r\n\x00v\r\n"
    # what the C packer does not take itself
    assert pack(("SET", True, bytearray(b"ab"), 1.5)) == b"*4\r\n$3\r\nSET\r\n$1\r\n1\r\n$2\r\nab\r\n$3\r\n1.5\r\n"
    with pytest.raises(TypeError, match="cannot send dict"):
        pack(("SET", {}))
    with pytest.raises(hiredis.ProtocolError):
        replies_of(b"?not RESP\r\n")


def test_supports():
    assert PipelinedRedis.supports("redis://127.0.0.1:6379/0")
    assert PipelinedRedis.supports("redis://:pw@host:1/3")
    assert PipelinedRedis.supports("rediss://host:6379/0?ssl_ca_certs=/etc/ca.pem")
    assert not PipelinedRedis.supports("redis://host:6379/0?protocol=3")
    assert not PipelinedRedis.supports("unix:///tmp/redis.sock")


@aio
async def test_pipelining_many_concurrent_calls(redis_url):
    r = PipelinedRedis(redis_url)
    try:
        results = await asyncio.gather(*(r.execute("ECHO", f"v{i}") for i in range(500)))
        assert results == [f"v{i}".encode() for i in range(500)]
        assert await r.execute("SET", "resp-test", b"x" * 100_000) == b"OK"
        assert await r.execute("GET", "resp-test") == b"x" * 100_000  # a reply split over many reads
        with pytest.raises(ReplyError, match="wrong number"):
            await r.execute("GET")
        assert await r.execute("PING") == b"PONG"  # an error reply leaves the connection usable
    finally:
        await r.close()


@aio
async def test_cancelled_call_does_not_shift_replies(redis_url):
    r = PipelinedRedis(redis_url)
    try:
        await r.execute("PING")
        slow = asyncio.ensure_future(r.execute("BLPOP", "resp-test-nothing", 0.2))
        await asyncio.sleep(0.01)
        slow.cancel()
        assert await r.execute("ECHO", "after") == b"after"
    finally:
        await r.close()


@aio
async def test_auth_and_db(tmp_path):
    server = start_redis(tmp_path / "redis")
    try:
        admin = PipelinedRedis(server.url)
        await admin.execute("CONFIG", "SET", "requirepass", "s3cret")
        await admin.close()
        r = PipelinedRedis(f"redis://:s3cret@127.0.0.1:{server.port}/2")
        await r.execute("SET", "k", "in-db-2")
        assert await r.execute("GET", "k") == b"in-db-2"
        await r.close()
        with pytest.raises(ReplyError, match="NOAUTH"):
            await PipelinedRedis(server.url).execute("GET", "k")
    finally:
        server.stop()


@aio
async def test_reconnects_after_redis_restart(tmp_path):
    server = start_redis(tmp_path / "redis")
    r = PipelinedRedis(server.url)
    try:
        assert await r.execute("PING") == b"PONG"
        server.restart()
        failures = 0
        for _ in range(3):  # the call that meets the dead connection fails; the next reconnects
            try:
                assert await r.execute("PING") == b"PONG"
                break
            except redis.exceptions.ConnectionError:
                failures += 1
        assert failures <= 1
        server.stop()
        with pytest.raises(redis.exceptions.ConnectionError):
            for _ in range(3):
                await r.execute("PING")
    finally:
        await r.close()
        server.stop()


# ---------------------------------------------------------------- Redis Cluster


def _empty_slot_tag(admin) -> tuple[str, int]:
    """A hash tag whose slot holds no key, so the tests may move that slot about."""
    for i in range(10_000):
        tag = f"resp-{i}"
        slot = admin.keyslot("{" + tag + "}")
        if admin.execute_command("CLUSTER COUNTKEYSINSLOT", slot, target_nodes=admin.get_node_from_key(tag)) == 0:
            return tag, slot
    raise AssertionError("no empty slot found")


def _set_slot(admin, slot: int, *args) -> None:
    for node in admin.get_primaries():
        admin.execute_command("CLUSTER SETSLOT", slot, *args, target_nodes=node)


@aio
async def test_cluster_routes_each_command_to_its_slots_master(redis_cluster_url):
    import redis as redis_sync

    from brigade.redis_clients import redis_py_url
    from brigade.resp import ClusterPipelinedRedis

    r = ClusterPipelinedRedis(redis_cluster_url)
    admin = redis_sync.RedisCluster.from_url(redis_py_url(redis_cluster_url))
    try:
        names = [f"resp-route-{i}" for i in range(30)]
        await asyncio.gather(*(r.execute("SET", n, n, key=n) for n in names))
        assert [admin.get(n) for n in names] == [n.encode() for n in names]
        assert len(r._nodes) == 3  # one connection per master: the 30 keys spread over all three
        with pytest.raises(ValueError, match="needs the key"):
            await r.execute("GET", names[0])
        admin.delete(*names)
    finally:
        await r.close()
        admin.close()


@aio
async def test_cluster_follows_moved_and_ask(redis_cluster_url):
    """A slot moved to another master (MOVED: the map is read again) and a slot being migrated
    (ASK: ASKING, then the command, on the importing node) both answer as if nothing happened."""
    import redis as redis_sync

    from brigade.redis_clients import redis_py_url
    from brigade.resp import ClusterPipelinedRedis

    admin = redis_sync.RedisCluster.from_url(redis_py_url(redis_cluster_url))
    tag, slot = _empty_slot_tag(admin)
    key = "{" + tag + "}:k"
    owner = admin.get_node_from_key(key)
    other = next(n for n in admin.get_primaries() if n.name != owner.name)
    ids = {n.name: admin.execute_command("CLUSTER MYID", target_nodes=n) for n in admin.get_primaries()}
    r = ClusterPipelinedRedis(redis_cluster_url)
    try:
        assert await r.execute("SET", key, "before", key=key) is not None  # the slot map is read here
        await r.execute("DEL", key, key=key)
        _set_slot(admin, slot, "NODE", ids[other.name])          # moved: r's map is stale now
        await r.execute("SET", key, "moved", key=key)
        assert admin.execute_command("GET", key, target_nodes=other) == b"moved"
        await r.execute("DEL", key, key=key)
        # migrating back: the slot's owner (other) answers ASK for a key it does not have
        admin.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[other.name], target_nodes=owner)
        admin.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[owner.name], target_nodes=other)
        await r.execute("SET", key, "asked", key=key)   # sent to `other` (its map), ASKed on to `owner`
        _set_slot(admin, slot, "NODE", ids[owner.name])   # the migration ends: what `owner` holds stays
        assert admin.get(key) == b"asked"
        admin.delete(key)
    finally:
        _set_slot(admin, slot, "NODE", ids[owner.name])
        await r.close()
        admin.close()
