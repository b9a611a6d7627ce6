"""The EPP's gRPC server: ``envoy.service.ext_proc.v3.ExternalProcessor`` and the gRPC health
services (``liveness``; ``readiness`` and the ext_proc service's own name, SERVING only
while the router core is ready: it knows the cluster, its index replica has synced, it is
not stopping), around a :class:`Router` that serves no HTTP port of its own (its operator
port, when set, serves ``/metrics`` and ``/debug/*`` as the router's does).

Invariant: every ext_proc stream ends its request (ticket released, outcome recorded), also
when the data plane drops the stream or the EPP stops: ``EppStream.close`` runs in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common.aio import cancel_and_wait
from services.common.logging import get_logger

from . import metrics as M
from .picker import Picker
from .stream import EppStream, ProtocolError

log = get_logger("epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
READY_POLL_S = 0.5  # how often Watch-ers learn a readiness change (Check reads it live)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, max_body_bytes: int, conformance: bool = False) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.conformance = conformance

    async def Process(  # noqa: N802 - the generated servicer's method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> None:
        # grpc.aio's read / write calls rather than iterating and yielding: no async
        # generator between the stream and the servicer (less CPU per message)
        s = EppStream(self.picker, self.max_body_bytes, self.conformance)
        try:
            while not s.done:
                req = await context.read()
                if req is grpc.aio.EOF:
                    s.data_plane_closed()
                    return
                for resp in await s.on(req):
                    await context.write(resp)
        except ProtocolError as exc:
            M.PROTOCOL_ERRORS.labels(exc.reason).inc()
            log.warning("ext_proc stream not followed", reason=exc.reason, error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            # a bug: this stream fails (the gateway applies its failureMode), not the EPP
            M.PROTOCOL_ERRORS.labels("internal").inc()
            log.exception("ext_proc stream failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"endpoint picker error: {exc}")
        finally:
            s.close()


class Health(HealthServicer):
    """Check answers readiness from the router's state at the time of the call."""

    def __init__(self, ready: Any) -> None:
        super().__init__()
        self.ready = ready

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.service in (READINESS, EXT_PROC_SERVICE):
            ok = self.ready()
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING
                if ok
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
        return await super().Check(request, context)


class EppServer:
    def __init__(self, router: Any, max_body_bytes: int, conformance: bool = False) -> None:
        self.router = router
        self.picker = Picker(router)
        self.stopping = False
        self.health = Health(self._ready)
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.picker, max_body_bytes, conformance), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._poll: asyncio.Task[None] | None = None
        self.port = 0

    def _ready(self) -> bool:
        return not self.stopping and self.router.readiness.ready()[0]

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the bound port."""
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        await self.server.start()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._poll = asyncio.create_task(self._publish_readiness(), name="epp-readiness")
        return self.port

    async def _publish_readiness(self) -> None:
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        while True:
            status = serving if self._ready() else not_serving
            for name in (READINESS, EXT_PROC_SERVICE):
                await self.health.set(name, status)
            await asyncio.sleep(READY_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """Not ready at once; streams in progress get ``grace_s`` to finish."""
        self.stopping = True
        if self._poll is not None:
            await cancel_and_wait([self._poll])
        for name in (READINESS, EXT_PROC_SERVICE):
            with contextlib.suppress(Exception):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def serve(st: Any, stop: asyncio.Event) -> None:
    from services.common.bus import Bus, NatsAuth
    from services.common.subjects import Subjects
    from services.router.app import Router, freeze_startup_heap
    from services.router.public_surface import start_operator_http

    # outcomes, load reports and the NATS connection name this process as an EPP (epp-<hex>
    # unless --router-id names it), not as a router
    st.router_id = st.router_id or f"epp-{uuid.uuid4().hex[:8]}"
    bus = Bus(
        st.nats_url,
        st.router_id,
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role="router",
    )
    await bus.connect()
    router = Router(st, bus)
    await router.start()
    conformance = bool(st.conformance_test_epp)
    if conformance:
        log.warning(
            "conformance test EPP: the test-epp-endpoint-selection header chooses the endpoint; "
            "for the Gateway API Inference Extension conformance suite only"
        )
    epp = EppServer(router, int(st.max_body_bytes), conformance)
    port = await epp.start(st.host, st.port)
    operator = await start_operator_http(st, router.operator_routes())
    freeze_startup_heap()  # as the router does
    log.info(
        "epp listening",
        host=st.host,
        port=port,
        router_id=router.router_id,
        policy=router.policies.control.spec,
    )
    await stop.wait()
    router.readiness.start_draining()
    await epp.stop(float(st.drain_timeout_s))
    if operator is not None:
        await operator.stop()
    await router.stop()
    await bus.close()
