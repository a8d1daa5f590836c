"""grpc.health.v1 status of the server and each service it offers.

Everything reports NOT_SERVING until the models are loaded and warmed up; then
`""` and each service with a model (stencil.v1.Generation,
stencil.v1.Embeddings, stencil.v1.Speech) turn SERVING, while a service
without one (a server started with --no-embedding-model or
--no-speech-model, or embeddings only) stays NOT_SERVING. On drain, or when an
engine dies (the server then stops), everything is NOT_SERVING again, for good.
While an engine hangs (service/ops/watchdog.py), the services that depend on it
are NOT_SERVING until it recovers.
"""

from __future__ import annotations

from collections.abc import Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import OVERALL_HEALTH, aio

__all__ = ["NOT_SERVING", "OVERALL_HEALTH", "SERVING", "HealthState"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState:
    """Owns the asyncio health servicer; `""` stands for the whole server."""

    def __init__(self, services: Sequence[str]):
        self.services = (OVERALL_HEALTH, *services)
        self.servicer = aio.HealthServicer()
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {}
        self._shut_down = False

    def status(self, name: str = OVERALL_HEALTH) -> health_pb2.HealthCheckResponse.ServingStatus:
        """What `name` reports now (NOT_SERVING before anything was set)."""
        return self._status.get(name, NOT_SERVING)

    def add_to_server(self, server) -> None:  # type: ignore[no-untyped-def]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_all(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in self.services:
            await self.set(name, status)

    async def set(self, name: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """One service's status (ignored once draining, as the servicer ignores it)."""
        if self._shut_down:
            return
        self._status[name] = status
        await self.servicer.set(name, status)

    async def not_serving(self) -> None:
        await self.set_all(NOT_SERVING)

    async def serving(self, services: Sequence[str] | None = None) -> None:
        """The server and `services` (default: all) SERVING; the others NOT_SERVING."""
        on = set(self.services if services is None else (OVERALL_HEALTH, *services))
        for name in self.services:
            await self.set(name, SERVING if name in on else NOT_SERVING)

    async def shut_down(self) -> None:
        """NOT_SERVING for every service, permanently (draining)."""
        await self.set_all(NOT_SERVING)
        self._shut_down = True
        await self.servicer.enter_graceful_shutdown()
