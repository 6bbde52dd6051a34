"""`python -m brigade.healthcheck [HOST:PORT]`: exit 0 when the proxy's standard gRPC health
service answers SERVING. Used by container health checks; needs neither torch nor a token."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from brigade.settings import PROXY


def main() -> int:
    target = sys.argv[1] if len(sys.argv) > 1 else PROXY.from_env()
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as e:
        print(f"unhealthy: {target}: {e.code().name}", file=sys.stderr)
        return 1
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    print("serving" if ok else f"not serving: {reply.status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
