"""A stream its client left still closes its generation and is charged: sse-starlette runs the
body in an anyio task group that it cancels on the disconnect, and anyio then cancels again at every
await, so a cleanup that waited on anything (the local backend gathering its choices' tasks, an
upstream's connection closing) ended the stream's ``finally`` there. Seen on a real server on tiny
models: about half the streams cut by their client were never charged to the key's tokens per
minute, and their log line and span said ``prompt_tokens=0``.

Driven here as sse-starlette drives it (a task group cancelled while the body awaits its next
delta), with a generation whose close waits, as the local backend's does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio

from gateway.backends import Delta, Generation
from gateway.formatting import ChatFormat
from gateway.serving import _events


class SlowClosing(Generation):
    """Its close awaits (a backend's tasks being gathered) before it is done."""

    closed = False

    async def aclose(self) -> None:
        await asyncio.sleep(0.01)
        await super().aclose()
        self.closed = True


async def one_delta_then_nothing() -> AsyncIterator[Delta]:
    yield Delta(0, "Hel", completion_tokens=1)
    await asyncio.Event().wait()  # the next one never comes: the client leaves first


async def test_a_stream_cut_by_its_client_still_closes_and_is_charged() -> None:
    gen = SlowClosing(prompt_tokens=3, deltas=one_delta_then_nothing())
    charged: list[bool] = []
    events = _events(gen, ChatFormat("m", False, 1), lambda: charged.append(True), cut=asyncio.Event())
    sent: list[str] = []
    first_chunk = asyncio.Event()

    async def body() -> None:  # sse-starlette's _stream_response
        async for data in events:
            sent.append(data)
            if len(sent) == 2:  # the role chunk and "Hel": now it waits for the next delta
                first_chunk.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
        await first_chunk.wait()
        await asyncio.sleep(0)  # the body is back waiting on the generation
        tg.cancel_scope.cancel()  # the client disconnected

    assert gen.closed, "the generation was not closed"
    assert charged == [True], "the stream's usage was not charged"
