"""A bare HTTP byte relay: the floor a Python gateway is measured against (benchmarks/peers.py).

    python benchmarks/relay.py --port PORT --upstream http://127.0.0.1:ENGINE

aiohttp on both sides, uvloop: every request's method, path, body and content-type go upstream
on a kept-alive connection, and the answer's status, content-type and body (streamed in the
chunks they arrive in) come back. No parsing, no logs, no metrics: what is left is HTTP itself.
Prints "ready" once it listens.
"""

from __future__ import annotations

import argparse

import aiohttp
import uvloop
from aiohttp import web


def app(upstream: str) -> web.Application:
    application = web.Application()
    state: dict[str, aiohttp.ClientSession] = {}

    async def start(_: web.Application) -> None:
        state["client"] = aiohttp.ClientSession(
            upstream, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )

    async def stop(_: web.Application) -> None:
        await state["client"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with state["client"].request(
            request.method, request.rel_url.path_qs, data=body, headers=headers
        ) as answer:
            out = web.StreamResponse(
                status=answer.status,
                headers={"content-type": answer.headers.get("content-type", "application/json")},
            )
            if answer.headers.get("transfer-encoding", "").lower() != "chunked":
                out.content_length = answer.content_length
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    application.router.add_route("*", "/{tail:.*}", relay)
    return application


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvloop.install()
    web.run_app(
        app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=lambda *_: print("ready", flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
