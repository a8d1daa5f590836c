"""HealthState: what it reports agrees with what grpc's health servicer answers."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from service.ops.health import NOT_SERVING, SERVING, HealthState


def test_nothing_turns_serving_again_after_a_drain() -> None:
    # The watchdog's recovery may set a service SERVING after the drain began:
    # the servicer ignored it, but status() said SERVING.
    async def run() -> tuple[int, int]:
        health = HealthState(["stencil.v1.Generation"])
        await health.serving()
        await health.shut_down()
        await health.set("stencil.v1.Generation", SERVING)
        answer = await health.servicer.Check(health_pb2.HealthCheckRequest(service="stencil.v1.Generation"), None)
        return health.status("stencil.v1.Generation"), answer.status

    assert asyncio.run(run()) == (NOT_SERVING, NOT_SERVING)
