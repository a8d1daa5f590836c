"""gRPC server reflection, both versions: `grpc.reflection.v1` and `v1alpha`.

grpcio-reflection ships only v1alpha, and tools that speak only v1 (newer
grpcurl, Postman, grpcui builds) found nothing. The two versions' messages are
the same on the wire (only the proto package differs), so one servicer answers
both; the v1 service's descriptor is the v1alpha file's, renamed, so v1 can
describe itself too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for fld in message.field:
            if fld.type_name.startswith(".grpc.reflection.v1alpha."):
                fld.type_name = fld.type_name.replace(".v1alpha.", ".v1.", 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(".v1alpha.", ".v1.", 1)
            method.output_type = method.output_type.replace(".v1alpha.", ".v1.", 1)
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) for `service_names` and itself."""
    pool = descriptor_pool.Default()
    _register_v1_descriptor(pool)
    servicer = ReflectionServicer([*service_names, V1_SERVICE, V1ALPHA_SERVICE], pool=pool)
    handlers = {}
    for service in (V1_SERVICE, V1ALPHA_SERVICE):
        handlers[service] = grpc.method_handlers_generic_handler(service, {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
        })
    server.add_generic_rpc_handlers(tuple(handlers.values()))
