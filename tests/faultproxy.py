"""An HTTP proxy in front of moto's S3 server that injects origin faults, per object.

Faults for GETs of keys matching a pattern, in order, one per request, then the
request goes through: ``"503"`` (SlowDown), ``"500"``, ``"reset"`` (headers and half
the body, then the connection closes), ``"truncate"`` (a full Content-Length, half the
body), ``"stall"`` (``stall_seconds``, 2 by default, before answering).
``"always500"`` fails every request.
``"lost"`` (for PUTs, with ``methods=("PUT",)``) forwards the request, so the write
lands, then closes the connection without an answer: a response lost on the way back.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import defaultdict

from aiohttp import ClientSession, web

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class OriginFaults:
    def __init__(
        self,
        upstream: str,
        plan: dict[str, list[str]],
        methods: tuple[str, ...] = ("GET",),
        stall_seconds: float = 2.0,
    ) -> None:
        self.stall_seconds = stall_seconds  # how long a "stall" holds a request
        self.upstream = upstream.rstrip("/")
        self.methods = methods
        self.plan = {re.compile(k): v for k, v in plan.items()}
        self.done: dict[str, int] = defaultdict(int)
        self.injected: dict[str, int] = defaultdict(int)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("the fault proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        async def session() -> ClientSession:
            return ClientSession(auto_decompress=False)

        self._session = self._loop.run_until_complete(session())
        self._ready.set()
        self._loop.run_forever()

    def _fault(self, request: web.Request) -> str | None:
        if request.method not in self.methods:
            return None
        for pattern, faults in self.plan.items():
            if pattern.search(request.path):
                if "always500" in faults:
                    return "500"
                n = self.done[request.path]
                self.done[request.path] += 1
                return faults[n] if n < len(faults) else None
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._fault(request)
        if fault:
            self.injected[fault] += 1
        if fault == "503":
            return web.Response(status=503, body=_SLOWDOWN, content_type="application/xml")
        if fault == "500":
            return web.Response(status=500, body=b"<Error><Code>InternalError</Code></Error>")
        if fault == "stall":
            await asyncio.sleep(self.stall_seconds)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        body = await request.read()
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body
        ) as upstream:
            payload = await upstream.read()
            out_headers = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in ("transfer-encoding", "content-encoding", "connection")
            }
            if fault == "lost":
                if request.transport is not None:
                    request.transport.close()  # the write landed; its answer never comes
                return web.Response(status=upstream.status)
            if fault in ("reset", "truncate") and len(payload) > 1:
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.content_length = len(payload)
                await response.prepare(request)
                await response.write(payload[: len(payload) // 2])
                if request.transport is not None:
                    request.transport.close()  # mid-body: a reset or a short body
                return response
            return web.Response(status=upstream.status, body=payload, headers=out_headers)
