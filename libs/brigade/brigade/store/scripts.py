"""Loading and calling the Lua scripts in `lua/`, by name.

Each script file declares its keys and arguments in its header:

    -- KEYS: work rollouts cursor
    -- ARGV: worker lease_ms ids...

(several `-- ARGV:` lines add up; a last name ending in `...` takes the rest of ARGV as a list).
A script that must run when Redis is full also says `-- FLAGS: allow-oom`. A script may instead be
made of others, `-- PARTS: complete acquire`: each part becomes a Lua function of that name, the
script takes the union of their names (a name two parts declare is one value and must mean the same
to both) and their flags (which must agree), and its own body calls them. One EVALSHA instead of
one per part: what a call costs the proxy and Redis besides the commands is paid once.
The loader prepends generated Lua that binds them by name, `K.work`, `A.worker`, `A.ids`, the
constants below, and `common.lua`. Callers pass every name as a keyword argument; a key named
like a `RunKeys` property (work, events, stats...) may instead come from the run's keys, passed
first. A missing or unknown name is a ValueError before Redis is called.

Every script answers `{'ok', value...}` or `{'err', kind, message}`; `Script.__call__` returns
the values and raises the refusal as a StoreError.

A full Redis (used memory over maxmemory, noeviction): every script is loaded with a `#!lua`
shebang (Redis 7), so Redis decides before the script runs. One without `allow-oom` (it grows the
state: acquire, complete, create_run, publish) is refused whole with an OOM error, which the proxy
answers as a transient RESOURCE_EXHAUSTED; one with it (heartbeats, failures, acks, the janitor's
sweeps and lock: what keeps leases alive and what frees memory) runs whole. Without the shebang,
Redis would refuse only a script's first memory-growing write, and let one whose first write was
another kind (XREADGROUP creating a consumer) grow on past the limit.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis

from brigade import keys
from brigade.errors import BY_KIND
from brigade.resp import ClusterPipelinedRedis, PipelinedRedis, ReplyError

EVENTS_MAXLEN = 10_000    # the events stream is capped (approximately) at this many entries
DEADLETTER_KEPT = 10_000  # so is the dead-letter stream (stats.deadlettered counts every one)
ADAPTERS_KEPT = 10_000    # adapter manifests (and evaluator results) of the newest versions kept in Redis
# automatic lookahead (acquire.lua) runs a worker this much further ahead than generation / training
# alone asks: a batch that takes 90 % of a step already gets two versions of room, so one slow batch
# (a noisy neighbour, a long completion) does not leave the learner waiting
LOOKAHEAD_SLACK = 1.15

# Python values the scripts see as Lua constants (substituted at load time, so one definition)
CONSTANTS = {
    "WORK_GROUP": keys.WORK_GROUP,
    "LEARNER_GROUP": keys.LEARNER_GROUP,
    "EVENTS_MAXLEN": EVENTS_MAXLEN,
    "DEADLETTER_KEPT": DEADLETTER_KEPT,
    "ADAPTERS_KEPT": ADAPTERS_KEPT,
    "BATCH_ID_FORMAT": keys.BATCH_ID_FORMAT,
    "LOOKAHEAD_SLACK": LOOKAHEAD_SLACK,
}

_HEADER = re.compile(r"^-- (KEYS|ARGV):(.*)$", re.MULTILINE)
_FLAGS = re.compile(r"^-- FLAGS:(.*)$", re.MULTILINE)
_PARTS = re.compile(r"^-- PARTS:(.*)$", re.MULTILINE)
SCRIPT_FLAGS = {"allow-oom"}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _lua_literal(value: str | int | float) -> str:
    if isinstance(value, int | float):
        return repr(value)
    if re.search(r"['\\\n]", value):
        raise ValueError(f"constant {value!r} cannot be a plain Lua string")
    return f"'{value}'"


@dataclass(frozen=True)
class Declaration:
    """A script's KEYS and ARGV names, in the order Redis receives them."""

    keys: tuple[str, ...]
    args: tuple[str, ...]
    rest: str = ""  # the variadic tail of ARGV ("" = none)

    @classmethod
    def parse(cls, name: str, source: str) -> Declaration:
        found: dict[str, list[str]] = {"KEYS": [], "ARGV": []}
        for kind, names in _HEADER.findall(source):
            found[kind] += names.split()
        ks, args = found["KEYS"], found["ARGV"]
        if not ks and not args:
            raise ValueError(f"{name}.lua declares no '-- KEYS:' / '-- ARGV:' header")
        rest = ""
        if args and args[-1].endswith("..."):
            rest = args.pop()[:-3]
        every = [*ks, *args, *([rest] if rest else [])]
        bad = [n for n in every if not _NAME.match(n)]
        if bad:
            raise ValueError(f"{name}.lua: bad names {bad} (lowercase identifiers; only the last ARGV may end in ...)")
        if len(set(every)) != len(every):
            raise ValueError(f"{name}.lua: a name is declared twice in {every}")
        return cls(tuple(ks), tuple(args), rest)

    @classmethod
    def union(cls, name: str, parts: dict[str, Declaration]) -> Declaration:
        """The names of a script made of `parts`, each once, in the order the parts declare them."""
        if any(d.rest for d in parts.values()):
            raise ValueError(f"{name}.lua: a part with a variadic ARGV tail cannot share a call")
        ks = tuple(dict.fromkeys(k for d in parts.values() for k in d.keys))
        args = tuple(dict.fromkeys(a for d in parts.values() for a in d.args))
        if both := set(ks) & set(args):
            raise ValueError(f"{name}.lua: {sorted(both)} is a key in one part and an argument in another")
        return cls(ks, args)

    def prelude(self) -> str:
        """Lua binding every declared name: K.<key>, A.<arg>, A.<rest> (a list)."""
        k = ", ".join(f"{n} = KEYS[{i}]" for i, n in enumerate(self.keys, 1))
        a = ", ".join(f"{n} = ARGV[{i}]" for i, n in enumerate(self.args, 1))
        lines = [f"local K = {{{k}}}", f"local A = {{{a}}}"]
        if self.rest:
            lines.append(f"A.{self.rest} = {{}}\n"
                         f"for i = {len(self.args) + 1}, #ARGV do A.{self.rest}[#A.{self.rest} + 1] = ARGV[i] end")
        return "\n".join(lines) + "\n"

    # worked out once per script, not on every call (bind runs on every lease call)
    @functools.cached_property
    def _run_key_names(self) -> tuple[str, ...]:
        """The declared keys a RunKeys has a property for (work, events...)."""
        return tuple(n for n in self.keys if isinstance(getattr(keys.RunKeys, n, None), property))

    @functools.cached_property
    def _wanted(self) -> frozenset[str]:
        return frozenset((*self.keys, *self.args, *([self.rest] if self.rest else [])))

    def bind(self, script: str, values: dict[str, object],
             run_keys: keys.RunKeys | None = None) -> tuple[list[object], list[object]]:
        """(KEYS, ARGV) in declared order, keys not in `values` taken from `run_keys` where it has
        a property of that name; ValueError naming what is missing or unknown."""
        if run_keys is not None:
            values = {**_run_key_values(self._run_key_names, run_keys), **values}
        if values.keys() != self._wanted:
            wanted = self._wanted
            missing, unknown = sorted(wanted - values.keys()), sorted(values.keys() - wanted)
            raise ValueError(f"script {script}: missing {missing}, unknown {unknown}")
        args = [values[n] for n in self.args]
        if self.rest:
            args += values[self.rest]
        return [values[n] for n in self.keys], args


@functools.lru_cache(maxsize=4096)
def _run_key_values(names: tuple[str, ...], run_keys: keys.RunKeys) -> dict[str, str]:
    """The run's key names a script declares (RunKeys builds each string anew; a lease call needs ~10).
    Callers copy the dict, never change it."""
    return {n: getattr(run_keys, n) for n in names}


def _flags(name: str, source: str) -> tuple[str, ...]:
    flags = tuple(f for line in _FLAGS.findall(source) for f in line.split())
    if set(flags) - SCRIPT_FLAGS:
        raise ValueError(f"{name}.lua: unknown flags {sorted(set(flags) - SCRIPT_FLAGS)}")
    return flags


def read_source(name: str) -> str:
    return resources.files("brigade.store").joinpath("lua", f"{name}.lua").read_text()


def script_names() -> list[str]:
    return sorted(p.name[:-4] for p in resources.files("brigade.store").joinpath("lua").iterdir()
                  if p.name.endswith(".lua") and p.name != "common.lua")


def text(value: bytes | str | int | None) -> str:
    """A Redis reply as text ('' for nil)."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def number(value: bytes | str | int | None, default: int = 0) -> int:
    """A Redis reply as an int (`default` for nil or empty)."""
    if value is None or value == b"" or value == "":
        return default
    return int(value)


def unwrap(name: str, reply: list) -> list:
    """The values of an {'ok', value...} reply; the StoreError of an {'err', kind, message} one."""
    status = text(reply[0]) if reply else ""
    if status == "ok":
        return reply[1:]
    if status == "err":
        raise BY_KIND[text(reply[1])](text(reply[2]))
    raise RuntimeError(f"script {name} answered {reply!r}, neither {{'ok', ...}} nor {{'err', kind, message}}")


class Script:
    """One script, run with EVALSHA: over the pipelined hot-path connection when there is one,
    else through redis-py. Loaded into Redis on first NOSCRIPT (after a restart or a flush)."""

    def __init__(self, name: str, client: aioredis.Redis, fast: PipelinedRedis | ClusterPipelinedRedis | None):
        own = read_source(name)
        self.name = name
        parts = {p: read_source(p) for line in _PARTS.findall(own) for p in line.split()}
        if any(_PARTS.search(source) for source in parts.values()):
            raise ValueError(f"{name}.lua: a part is made of parts itself")
        if parts:
            self.declaration = Declaration.union(name, {p: Declaration.parse(p, s) for p, s in parts.items()})
            flags = {p: _flags(p, s) for p, s in parts.items()}
            if len(set(flags.values())) > 1:
                raise ValueError(f"{name}.lua: its parts' flags differ: {flags}")
            flags_of_all = next(iter(flags.values()))
            body = "".join(f"local function {p}()\n{s}\nend\n" for p, s in parts.items()) + own
        else:
            self.declaration = Declaration.parse(name, own)
            flags_of_all, body = _flags(name, own), own
        constants = "".join(f"local {k} = {_lua_literal(v)}\n" for k, v in CONSTANTS.items())
        shebang = "#!lua" + (f" flags={','.join(flags_of_all)}" if flags_of_all else "") + "\n"
        self.source = shebang + constants + self.declaration.prelude() + read_source("common") + body
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self._fast = fast
        self._script = client.register_script(self.source)

    async def __call__(self, run_keys: keys.RunKeys | None = None, /, **values: object) -> list:
        ks, args = self.declaration.bind(self.name, values, run_keys)
        return unwrap(self.name, await self._run(ks, args))

    async def _run(self, ks: list[object], args: list[object]) -> list:
        fast = self._fast
        if fast is None:
            return await self._script(keys=ks, args=args)
        key = ks[0]  # on a cluster: the slot, so the node, of every key of the call
        try:
            return await fast.execute("EVALSHA", self.sha, len(ks), *ks, *args, key=key)
        except ReplyError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await fast.execute("SCRIPT", "LOAD", self.source, key=key)
        return await fast.execute("EVALSHA", self.sha, len(ks), *ks, *args, key=key)


class Scripts:
    """Every script of `lua/`, loaded once per store: `scripts.acquire(work=..., worker=...)`."""

    def __init__(self, client: aioredis.Redis, fast: PipelinedRedis | ClusterPipelinedRedis | None):
        for name in script_names():
            setattr(self, name, Script(name, client, fast))
