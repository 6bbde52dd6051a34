"""Server reflection under both names clients ask for: `grpc.reflection.v1` (grpcurl 1.9+, the Node
client) and `grpc.reflection.v1alpha` (older tools).

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages, field for field and
number for number, in another package, so the same servicer answers both: its requests and replies
are identical on the wire. The v1 file itself (`grpc/reflection/v1/reflection.proto`) is built from
the v1alpha one with the package renamed and added to the default pool, so a client can also ask
reflection to describe v1 (grpcurl does).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_METHOD = f"/{V1_SERVICE}/ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = V1_PACKAGE
    proto.ClearField("options")  # java/go package options name the v1alpha package
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for m in service.method:
            m.input_type = m.input_type.replace(old, f".{V1_PACKAGE}.")
            m.output_type = m.output_type.replace(old, f".{V1_PACKAGE}.")
    return proto


def _v1_registered() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
    except KeyError:
        pool.Add(_v1_file())


def v1_messages() -> tuple[type, type]:
    """The v1 ServerReflectionRequest and ServerReflectionResponse classes (for clients and tests)."""
    _v1_registered()
    pool = descriptor_pool.Default()
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{V1_PACKAGE}.{name}"))
                 for name in ("ServerReflectionRequest", "ServerReflectionResponse"))


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection v1 and v1alpha on `server`, listing `service_names` and both reflection services."""
    _v1_registered()
    servicer = v1alpha.aio.ReflectionServicer((*service_names, V1_SERVICE, v1alpha.SERVICE_NAME))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for name in (V1_SERVICE, v1alpha.SERVICE_NAME):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),))
