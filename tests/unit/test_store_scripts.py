"""The Lua loader: every script declares its KEYS and ARGV, loads, and is called by name only."""

from __future__ import annotations

import re

import pytest
import redis.asyncio as aioredis

from brigade import keys
from brigade.store.scripts import CONSTANTS, Declaration, Script, read_source, script_names

COMPOSED = {"complete_acquire": ("complete", "acquire")}  # scripts made of others (-- PARTS:)
EXPECTED = {"ack", "acquire", "claim_run", "compact", "complete", "contribute", "create_run", "expire", "fail",
            "heartbeat",
            "lock_release", "lock_renew", "prune_consumers", "publish", "register_run", "remove_stale", "revoke",
            *COMPOSED}
GLOBAL_KEY_SCRIPTS = {"claim_run", "lock_release", "lock_renew", "register_run"}  # one global key each, no run's keys


def _script(name: str) -> Script:
    # never connects: building a Script only registers the source with the client object
    return Script(name, aioredis.Redis.from_url("redis://127.0.0.1:1/0"), None)


def test_every_script_is_found():
    assert set(script_names()) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED - set(COMPOSED)))
def test_every_script_declares_what_it_uses(name):
    own = read_source(name)
    d = Declaration.parse(name, own)
    assert d.keys or d.args
    # inside the script, only the declared names, never a KEYS[i] / ARGV[i] position
    assert not re.search(r"\b(KEYS|ARGV)\[", own), f"{name}.lua indexes KEYS/ARGV by position"
    used_keys = set(re.findall(r"\bK\.(\w+)", own))
    used_args = set(re.findall(r"\bA\.(\w+)", own))
    assert used_keys <= set(d.keys), used_keys - set(d.keys)
    assert used_args <= {*d.args, d.rest} - {""}, used_args - set(d.args)
    assert set(d.keys) <= used_keys and set(d.args) <= used_args, "declared but unused"
    # group names come from brigade.keys, never spelled out in a stream command
    stream_command = r"'(XACK|XREADGROUP|XGROUP|XPENDING|XAUTOCLAIM|XCLAIM)'"
    group_calls = [ln for ln in own.splitlines() if re.search(stream_command, ln)]
    assert not [ln for ln in group_calls if re.search(r"'(rollout|learner)'", ln)]
    assert "return {'ok'" in own


def test_no_script_mixes_a_global_key_with_a_runs_keys():
    """On Redis Cluster a script may touch one hash slot only: a run's keys share one (the {run}
    tag), a global key has its own, so a script declares either one global key or only run keys."""
    run_keys = {n for n in dir(keys.RunKeys) if isinstance(getattr(keys.RunKeys, n), property)} - {"prefix"}
    for name in EXPECTED - set(COMPOSED):
        declared = set(Declaration.parse(name, read_source(name)).keys)
        if name in GLOBAL_KEY_SCRIPTS:
            assert len(declared) == 1 and not declared & run_keys, (name, declared)
        else:  # run keys, or keys the store builds from the run's prefix (lease, staged, stream)
            assert declared & run_keys or name == "prune_consumers", (name, declared)


def test_loaded_source_binds_names_constants_and_common():
    s = _script("acquire")
    assert s.source.startswith("#!lua\nlocal WORK_GROUP = 'rollout'\n")
    assert "local K = {work = KEYS[1], rollouts = KEYS[2]," in s.source
    assert "local function requeue(" in s.source and s.source.endswith(read_source("acquire"))
    assert all(f"local {c} = " in s.source for c in CONSTANTS)


def test_a_composed_script_is_its_parts_as_functions_over_the_union_of_their_names():
    s, parts = _script("complete_acquire"), [Declaration.parse(p, read_source(p)) for p in COMPOSED["complete_acquire"]]
    union_keys = [k for i, d in enumerate(parts) for k in d.keys if all(k not in e.keys for e in parts[:i])]
    assert list(s.declaration.keys) == union_keys and "worker" in parts[0].args and "worker" in parts[1].args
    assert s.declaration.args.count("worker") == 1  # one value for both parts
    assert "local function complete()\n" in s.source and "local function acquire()\n" in s.source
    assert s.source.startswith("#!lua\n") and s.source.endswith(read_source("complete_acquire"))
    assert not re.search(r"\b[KA]\.", read_source("complete_acquire"))  # its own body only calls the parts


@pytest.mark.parametrize("parts, error", [
    ({"x": "-- KEYS: a\n-- ARGV: ids...\n"}, "variadic"),
    ({"x": "-- KEYS: a\n", "y": "-- ARGV: a\n"}, "a key in one part and an argument in another"),
])
def test_parts_that_cannot_share_a_call(parts, error):
    with pytest.raises(ValueError, match=error):
        Declaration.union("t", {n: Declaration.parse(n, src) for n, src in parts.items()})


def test_call_by_name_binds_in_declared_order():
    d = Declaration.parse("t", "-- KEYS: a b\n-- ARGV: x\n-- ARGV: y ids...\n")
    assert (d.keys, d.args, d.rest) == (("a", "b"), ("x", "y"), "ids")
    assert d.bind("t", dict(y=2, b="kb", ids=["i1", "i2"], x=1, a="ka")) == (["ka", "kb"], [1, 2, "i1", "i2"])
    assert "for i = 3, #ARGV do A.ids[#A.ids + 1] = ARGV[i] end" in d.prelude()


def test_run_keys_fill_only_keys_named_like_them():
    d = Declaration.parse("t", "-- KEYS: work lease events\n-- ARGV: work_ms\n")
    k = keys.RunKeys("r")
    assert d.bind("t", dict(lease="L", work_ms=5), k) == ([k.work, "L", k.events], [5])
    assert d.bind("t", dict(lease="L", work_ms=5, events="mine"), k)[0][2] == "mine"  # explicit wins
    with pytest.raises(ValueError, match=r"missing \['lease'\]"):  # RunKeys.lease is a method, not a key
        d.bind("t", dict(work_ms=5), k)


async def test_missing_or_unknown_name_is_refused_before_redis():
    s = _script("lock_release")  # KEYS: lock  ARGV: owner; the client points at a closed port
    with pytest.raises(ValueError, match=r"missing \['owner'\], unknown \[\]"):
        await s(lock="k")
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['ttl_ms'\]"):
        await s(lock="k", owner="me", ttl_ms=5)


@pytest.mark.parametrize("header, error", [
    ("-- nothing declared\nreturn {'ok'}", "declares no"),
    ("-- KEYS: a a\n", "declared twice"),
    ("-- KEYS: a\n-- ARGV: a\n", "declared twice"),
    ("-- ARGV: rest... x\n", "bad names"),
    ("-- KEYS: Work\n", "bad names"),
])
def test_bad_declarations(header, error):
    with pytest.raises(ValueError, match=error):
        Declaration.parse("t", header)


@pytest.mark.parametrize("pipelined", [True, False])
async def test_every_script_compiles_and_reloads_after_a_flush(redis_url, pipelined):
    """SCRIPT LOAD compiles each assembled script in a real Redis; after SCRIPT FLUSH (a restart
    loses them too) the next call loads it again, over either connection."""
    from brigade.store import Store

    store = Store(redis_url, pipelined=pipelined)
    try:
        for name in script_names():
            sha = await store.redis.script_load(getattr(store.scripts, name).source)
            assert sha == getattr(store.scripts, name).sha
        await store.redis.script_flush()
        lock = f"test-lock-{pipelined}"
        assert await store.sweeps.lock_acquire(lock, "me", 5_000)
        assert await store.sweeps.lock_renew(lock, "me", 5_000)  # NOSCRIPT, then loaded and run
        assert not await store.sweeps.lock_release(lock, "someone else")
        assert await store.sweeps.lock_release(lock, "me")
    finally:
        await store.close()
