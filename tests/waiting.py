"""Waiting on conditions with deadlines (tests never sleep a fixed time before asserting), and
stand-in HTTP peers served on a loopback port of the system's choosing."""

import asyncio
import contextlib
import inspect
import socket
import time

import aiohttp
from aiohttp import web


async def wait_until(condition, timeout: float = 60.0, what: str = "condition", seen=None):
    """Poll ``condition`` (a function, possibly async) until it is true and return its value; fail
    the test after ``timeout`` seconds saying ``what`` and, given ``seen`` (a function, possibly
    async), what it finds then: the state the test saw instead."""
    deadline = time.monotonic() + timeout
    while True:
        result = await _value(condition)
        if result:
            return result
        if time.monotonic() >= deadline:
            last = f"; last seen: {await _value(seen)}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{last}")
        await asyncio.sleep(0.02)


def wait_for(condition, what: str, timeout_s: float = 60.0, seen=None):
    """``wait_until`` for plain (not async) code: poll ``condition`` until it is truthy and return it; fail
    after ``timeout_s`` saying ``what`` and, given ``seen``, what ``seen()`` finds then."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what}"
                + (f"; last seen: {seen()}" if seen is not None else "")
            )
        time.sleep(0.02)
    return value


async def _value(function):
    result = function()
    return await result if inspect.isawaitable(result) else result


async def model_info(server: str) -> dict:
    """A rollout server's /get_model_info (running and waiting requests, version, ...)."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{server}/get_model_info") as response:
        return await response.json()


@contextlib.asynccontextmanager
async def serve_on_loopback(app: web.Application):
    """Serve ``app`` on 127.0.0.1 (a port bound before serving, so never raced); yields ``host:port``."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
