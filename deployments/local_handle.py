"""A deployment's object in this process, called as Serve's handles call a replica.

The colocated server (deployments.app.Server) keeps the HTTP routes and the decoder in one replica:
the routes' code stays the code they run against a DeploymentHandle (`.remote()`, awaited or
iterated, `.cancel()`), and each call is a local call instead of a Ray message per request and
per streamed chunk. Serve resolves the replies of other deployments passed as arguments (the
encoder's outputs, the vision encoder's features) before a replica's method runs; so does this.
"""

from __future__ import annotations

import asyncio
import inspect


async def _resolved(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every Serve reply among them awaited, as Serve does for a replica
    (a reply of a handle in this process too: anything awaitable)."""

    async def value(v):
        return await v if inspect.isawaitable(v) else v

    return (tuple([await value(a) for a in args]),
            {k: await value(v) for k, v in kwargs.items()})


class LocalResponse:
    """A method call's reply, as DeploymentResponse: awaited for the value, cancel() stops it."""

    def __init__(self, method, args: tuple, kwargs: dict, threaded: bool = False):
        async def call():
            a, k = await _resolved(args, kwargs)
            if threaded and not inspect.iscoroutinefunction(method):  # as Serve runs a sync method: off the loop
                return await asyncio.to_thread(method, *a, **k)
            out = method(*a, **k)
            return await out if inspect.isawaitable(out) else out

        self._task = asyncio.ensure_future(call())

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class LocalStream:
    """An async generator method's items, as DeploymentResponseGenerator: iterated; cancel() closes
    it (the generator's cleanup runs: the decoder frees the request's row)."""

    def __init__(self, method, args: tuple, kwargs: dict):
        async def items():
            a, k = await _resolved(args, kwargs)
            stream = method(*a, **k)
            try:
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()

        self._items = items()

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._items.__anext__()

    def cancel(self) -> None:
        async def close():
            try:
                await self._items.aclose()
            except RuntimeError:  # a step of it still runs: that step's cancellation ends it
                pass

        asyncio.ensure_future(close())


class _Method:
    def __init__(self, method, threaded: bool):
        self._method, self._threaded = method, threaded

    def remote(self, *args, **kwargs):
        if inspect.isasyncgenfunction(self._method):
            return LocalStream(self._method, args, kwargs)
        return LocalResponse(self._method, args, kwargs, self._threaded)


class LocalHandle:
    """`handle.method.remote(...)` on `target` in this process (`options(...)` is accepted and
    ignored: a generator method always streams). `threaded`: a sync method runs on a worker
    thread, as Serve runs it (a store's file writes stay off the routes' event loop)."""

    def __init__(self, target, threaded: bool = False):
        self._target, self._threaded = target, threaded

    def options(self, **_) -> "LocalHandle":
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self._threaded)
