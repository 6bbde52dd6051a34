"""CreateRun over real gRPC (the proxy in a background thread, real redis-server) fills in the
declared defaults, so a client in any language may send only run_id, model and dataset."""

from __future__ import annotations

import grpc
import pytest
from proxy_support import make_prompts, new_run_id

from brigade.spec_file import build_spec, spec_to_dict
from brigade.v1 import brigade_pb2 as pb


def test_a_bare_spec_gets_every_default(proxy_client):
    run = new_run_id("bare")
    bare = pb.RunSpec(run_id=run, model="org/model", dataset="prompts.jsonl")
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=bare, prompts=make_prompts(3)), metadata=proxy_client.metadata)
    got = proxy_client.runs.GetRun(pb.RunRef(run_id=run), metadata=proxy_client.metadata).spec
    expected = build_spec({"run_id": run, "model": "org/model", "dataset": "prompts.jsonl"})
    assert spec_to_dict(got) == spec_to_dict(expected)
    assert got.grpo.learning_rate == 1e-4 and got.eval_every == 5 and got.rewards[0].function == "demo_sum"
    # the same bare request again is the same run, not a different spec
    again = proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=bare, prompts=make_prompts(3), exist_ok=True),
                                        metadata=proxy_client.metadata)
    assert not again.created


def test_explicit_zeros_of_optional_fields_survive(proxy_client):
    run = new_run_id("zeros")
    spec = pb.RunSpec(run_id=run, model="m", dataset="d", eval_every=0, grpo=pb.GrpoSpec(max_grad_norm=0.0, eps_low=0.0),
                      staleness=pb.StalenessSpec(max_staleness=0))
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=make_prompts(1)), metadata=proxy_client.metadata)
    got = proxy_client.runs.GetRun(pb.RunRef(run_id=run), metadata=proxy_client.metadata).spec
    assert (got.eval_every, got.grpo.max_grad_norm, got.grpo.eps_low, got.staleness.max_staleness) == (0, 0.0, 0.0, 0)
    assert got.grpo.eps_high == 0.28 and got.prompts_per_batch == 8


def test_required_fields_are_not_defaulted(proxy_client):
    with pytest.raises(grpc.RpcError) as err:
        proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=pb.RunSpec(run_id=new_run_id("nomodel")),
                                                        prompts=make_prompts(1)), metadata=proxy_client.metadata)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model: is required" in err.value.details() and "dataset: is required" in err.value.details()
