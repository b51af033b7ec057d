"""The API's routes the gateway answers: the proxied ones (each handed to `Proxy.handle`,
with its `Expect: 100-continue` answered only once the key and the size pass) and the
model list, which the gateway answers itself from the instances' lists.
May import: `gateway.server.resources` and every package below `gateway.server`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway import errors
from gateway.observe import recorder, request_id
from gateway.proxy import tenants
from gateway.routes import Route, mount
from gateway.server.resources import CONFIG, DISPATCHER, PROBER, PROXY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(router: web.UrlDispatcher, prefixes: tuple[str, ...]) -> None:
    """Every proxied route under each prefix, then each prefix's model list."""
    for path, route in mount(prefixes):
        expect = functools.partial(_expect, api=route.api)
        router.add_post(path, _proxied_route(route), expect_handler=expect)
    for prefix in prefixes:
        router.add_get(prefix + "/models", _models)


def _proxied_route(route: Route) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request, route)

    handler.__name__ = f"{route.api}_{route.name.replace('.', '_')}"
    return handler


async def _expect(request: web.Request, api: errors.Api) -> web.StreamResponse | None:
    """`Expect: 100-continue` is answered only once the key and the declared size pass.

    aiohttp's default answers `100 Continue` to anyone, inviting the body of a request
    the gateway will refuse. What this returns is sent as is (middlewares do not run),
    with `Connection: close`: the client may send the body anyway.
    """
    expect = request.headers.get("Expect", "")
    try:
        if expect.lower() != "100-continue":
            raise errors.ExpectationFailed(
                f"Expect {expect[:80]!r} is not supported: only '100-continue' is", param="Expect"
            )
        proxy = request.app[PROXY]
        proxy.intake.authorize(request)
        length = request.content_length
        if length is not None and length > proxy.intake.max_body:
            raise errors.PayloadTooLarge(
                f"the declared body of {length} bytes is larger than the gateway's limit "
                f"of {proxy.intake.max_body} bytes"
            )
    except errors.GatewayError as exc:
        response = exc.response({request_id.HEADER: request_id.of(request)}, api)
        response.force_close()
        prefixes = request.app[CONFIG].route_prefixes
        recorder.record_refusal(request.app[PROXY], request, response, prefixes)
        return response
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started
    return None


async def _models(request: web.Request) -> web.StreamResponse:
    dispatcher = request.app[DISPATCHER]
    up = dispatcher.snapshot().up()
    if not up:
        raise errors.NoInstanceAvailable(
            "no vLLM instance is up", retry_after=dispatcher.retry_after
        )
    data = request.app[PROBER].model_union({i.name for i in up})
    listed = {m["id"] for m in data}
    for instance in up:  # pinned models of instances that hide the route
        if instance.pinned_models is not None:
            for model in sorted(instance.pinned_models - listed):
                data.append({"id": model, "object": "model", "owned_by": "vllm"})
                listed.add(model)
    allowed = request.get(tenants.TENANT, tenants.DEFAULT).models
    if allowed is not None:  # a key sees only the models it may use, as OpenAI lists them
        data = [m for m in data if m["id"] in allowed]
    # The list is the union of the instances' own: each of them answered it, in part.
    instances = ", ".join(i.name for i in up)
    return web.json_response(
        {"object": "list", "data": data}, headers={"X-Gateway-Instance": instances}
    )
