"""A LeaseService that does no work: it parses each request and answers the same granted lease,
with no Redis, no checks, no interceptors. Served the way the proxy is served (grpc.aio on uvloop,
the proxy's server options, the startup heap out of the collector's sight), it is what gRPC alone
costs per call on this machine: the proxy bench drives it with the same clients at the same rate,
so every run says which part of a p99 the machine gives any Python gRPC server.

    python -m brigade_bench.floor_server PORT
"""

from __future__ import annotations

import sys


async def serve(port: int) -> None:
    import grpc

    from brigade.rpc import server_options
    from brigade.v1 import brigade_pb2 as pb
    from brigade_proxy.server import settle_heap

    # as big as the proxy's answer to the bench's run: one prompt, a seed, a deadline
    lease = pb.Lease(lease_id="1764780000000-0", run_id="bench-proxy", attempt=1, adapter_version=0,
                     batch=pb.PromptBatch(batch_id="bench-proxy:0:1", run_id="bench-proxy",
                                          prompts=[pb.Prompt(id="1", text="1 + 1 =")]),
                     seed=2**63,
                     deadline_ms=1764780600000, lease_seconds=600)
    granted = pb.AcquireLeaseResponse(granted=True, lease=lease)
    completed = pb.CompleteLeaseResponse(next=granted)

    async def acquire(request: pb.AcquireLeaseRequest, context) -> pb.AcquireLeaseResponse:
        return granted

    async def complete(request: pb.CompleteLeaseRequest, context) -> pb.CompleteLeaseResponse:
        return completed

    service = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
    handlers = {
        "AcquireLease": grpc.unary_unary_rpc_method_handler(
            acquire, pb.AcquireLeaseRequest.FromString, pb.AcquireLeaseResponse.SerializeToString),
        "CompleteLease": grpc.unary_unary_rpc_method_handler(
            complete, pb.CompleteLeaseRequest.FromString, pb.CompleteLeaseResponse.SerializeToString),
    }
    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise SystemExit(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    settle_heap()
    await server.wait_for_termination()


def main() -> None:
    import uvloop

    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit("usage: python -m brigade_bench.floor_server PORT")
    uvloop.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
