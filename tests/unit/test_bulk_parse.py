"""CreateRun's bulk parse (brigade_proxy.bulk): prompts counted before parsing, the request parsed in
pieces that make exactly the message a whole parse makes, and refusals that never parse the whole."""

from __future__ import annotations

import grpc
import pytest

from brigade.spec_file import build_spec
from brigade.v1 import brigade_pb2 as pb
from brigade_proxy.bulk import bulk_deserializer, parse_chunked, split
from brigade_proxy.calls import Refused


def request(n: int) -> pb.CreateRunRequest:
    spec = build_spec({"run_id": "bulk", "prompts_per_batch": 2, "batches_per_step": 1})
    return pb.CreateRunRequest(spec=spec, exist_ok=True,
                               prompts=[pb.Prompt(id=f"p{i}", text="x" * (i % 300), columns={"a": str(i)})
                                        for i in range(n)])


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 2501])
def test_pieces_parse_to_the_whole(n):
    data = request(n).SerializeToString()
    count, cuts = split(data, 2, 10_000, every=100)
    assert count == n and cuts[0] == 0 and cuts[-1] == len(data)
    assert parse_chunked(pb.CreateRunRequest, data, cuts) == pb.CreateRunRequest.FromString(data)


def test_fields_in_any_order_and_spec_after_prompts():
    whole = request(300)
    data = pb.CreateRunRequest(prompts=whole.prompts).SerializeToString() + \
        pb.CreateRunRequest(spec=whole.spec, exist_ok=True).SerializeToString()
    _, cuts = split(data, 2, 10_000, every=50)
    assert parse_chunked(pb.CreateRunRequest, data, cuts) == whole


def test_too_many_prompts_refused_before_parsing(monkeypatch):
    import brigade_proxy.bulk as bulk

    monkeypatch.setattr(bulk, "parse_chunked", lambda *a: pytest.fail("parsed a refused request"))
    safe = lambda data: pytest.fail("parsed whole")  # noqa: E731
    out = bulk_deserializer(pb.CreateRunRequest, 1 << 20, "prompts", 100, safe, Refused)(
        pb.CreateRunRequest().SerializeToString() + b"\x12\x00" * 101)
    assert isinstance(out, Refused) and out.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 100" in out.message


def test_malformed_and_oversized_refused():
    from brigade_proxy.calls import _safe_deserializer

    safe = _safe_deserializer(pb.CreateRunRequest, 1000)
    deserialize = bulk_deserializer(pb.CreateRunRequest, 1000, "prompts", 100, safe, Refused)
    for bad in (b"\x12\x05ab", b"\x12", b"\x0b\x00", b"\xff"):
        out = deserialize(bad)
        assert isinstance(out, Refused) and out.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    out = deserialize(b"\x12\x00" * 600)
    assert isinstance(out, Refused) and out.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = request(5)
    ok.spec.ClearField("run_id")
    assert deserialize(ok.SerializeToString()) == ok
