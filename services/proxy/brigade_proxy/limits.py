"""The proxy's limits: each one declared once here, with its default, its bounds and what it bounds.

`brigade proxy` has a flag and a BRIGADE_* variable for each (cli.py builds them from this table);
the README lists them. What is refused beyond a limit:

- a request over its method's size: RESOURCE_EXHAUSTED, before it is parsed (CreateRun may be up to
  max_message_bytes, which is also gRPC's receive limit, the most any one call can buffer; every
  other method up to max_request_bytes);
- a CreateRun beyond max_create_runs at once, a WatchRun beyond max_streams (in total) or
  max_streams_per_client (per client address), a PullRollouts beyond max_pulls or
  max_pulls_per_client: RESOURCE_EXHAUSTED, transient (`brigade.rpc.is_transient`), before the
  request is read;
- any call beyond max_rpcs in flight: gRPC's own RESOURCE_EXHAUSTED, before the request is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from brigade.spec import MAX_PROMPTS

MIB = 1024 * 1024


def _limit(default: int, low: int, high: int, doc: str) -> Any:
    return field(default=default, metadata={"low": low, "high": high, "doc": doc})


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = _limit(32 * MIB, 1 * MIB, 1024 * MIB,
                                    "bytes of a CreateRun request (its prompt set); gRPC's receive limit")
    max_request_bytes: int = _limit(4 * MIB, 64 * 1024, 1024 * MIB, "bytes of a request of any other method")
    # at most the store's own ceiling (brigade.spec.MAX_PROMPTS): an operator may only lower it
    max_prompts: int = _limit(MAX_PROMPTS, 1, MAX_PROMPTS, "prompts in one CreateRun")
    max_create_runs: int = _limit(2, 1, 64, "CreateRun calls in flight at once (each may hold max_message_bytes)")
    max_streams: int = _limit(256, 1, 100_000, "WatchRun streams open at once, in total (one Redis connection each)")
    max_streams_per_client: int = _limit(16, 1, 100_000, "WatchRun streams open at once from one client address")
    max_pulls: int = _limit(32, 1, 10_000,
                            "PullRollouts in flight at once, in total (Redis connections reserved for them)")
    max_pulls_per_client: int = _limit(4, 1, 10_000, "PullRollouts in flight at once from one client address")
    max_rpcs: int = _limit(4096, 16, 1_000_000, "calls in flight at once, of every kind (gRPC's own limit)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, low, high = getattr(self, f.name), f.metadata["low"], f.metadata["high"]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{f.name} must be an integer in [{low}, {high}], not {value!r}")
        if self.max_request_bytes > self.max_message_bytes:
            raise ValueError("max_request_bytes cannot exceed max_message_bytes (gRPC's receive limit)")

    @classmethod
    def doc(cls, name: str) -> str:
        f = next(f for f in fields(cls) if f.name == name)
        doc = f.metadata["doc"]
        return f"{doc[:1].upper()}{doc[1:]} ({f.metadata['low']}..{f.metadata['high']})"
