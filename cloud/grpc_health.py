"""The standard grpc.health.v1 service beside the verifier's own ``Health``: what load balancers and Kubernetes
``grpc`` probes ask."""
from __future__ import annotations

import grpc


def standard_health(server: grpc.aio.Server):
    """grpc.health.v1 beside our own Health, for load balancers and Kubernetes ``grpc`` probes: SERVING for the
    server ("") and the Verifier service until the server drains. None without grpcio-health-checking (the
    server extra has it)."""
    try:
        from grpc_health.v1 import health, health_pb2_grpc
    except ImportError:
        return None
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def set_health(servicer, serving: bool) -> None:
    from grpc_health.v1 import health_pb2
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", "tandem.v1.Verifier"):
        await servicer.set(service, status)
