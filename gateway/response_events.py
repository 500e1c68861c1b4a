"""Deltas -> the Responses API's response object and its typed stream events.

The same ``Delta`` sequence the chat format folds (text, then tool-call pieces, then a finish)
becomes output items in order: text opens a ``message`` item (one ``output_text`` part), each call
a ``function_call`` item; an item closes when another opens or the output ends. Streamed, each
step is one or more events, every one ``event: <type>`` plus ``data: {"type", "sequence_number",
...}``, in the order OpenAI sends them (../shared/OPENAI-CONTRACT.md): ``response.created``,
``response.in_progress``, per item ``output_item.added`` (a message's ``content_part.added``),
its deltas, its ``.done`` events, ``output_item.done``; then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``, ``response.failed`` on a fault). No ``[DONE]``.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.backends import Delta, Generation, Job
from gateway.formatting import ChatFormat, sse_json

Event = tuple[str, dict[str, Any]]  # (type, the payload's other fields)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat(ChatFormat):
    """One response (``n`` is 1 in this API). ``fields``: what the response object repeats from the
    request (tools, tool_choice, text, instructions, metadata...); ``keep``: stores the finished
    response (``store: true``), awaited before the client sees it finished, so a
    ``previous_response_id`` sent as soon as it has the answer finds it."""

    prefix = "resp_"

    def __init__(
        self,
        model: str,
        job: Job,
        fields: dict[str, Any],
        keep: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ):
        super().__init__(model, False, 1, calls_only=job.calls_only, calls_tools=job.calls_tools)
        self.id = new_id("resp")
        self.fields = fields
        self.keep = keep
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items, in order; the last may still be open
        self.open = False
        self.final: dict[str, Any] | None = None

    # ---- the response object ---------------------------------------------------------------

    def response(
        self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": copy.deepcopy(self.output) if status != "in_progress" else [],
            "error": error,
            "incomplete_details": incomplete,
            "usage": usage,
            **self.fields,
        }

    def usage_of(self, gen: Generation) -> dict[str, Any]:
        """The chat usage in the Responses API's words, with the same speculation stats."""
        chat = self.usage(gen)
        details = getattr(chat, "prompt_tokens_details", None)  # prefix caching's count, once it exists
        cached = (details.get("cached_tokens") if isinstance(details, dict) else None) or 0
        out: dict[str, Any] = {
            "input_tokens": chat.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat.total_tokens,
        }
        if chat.speculative is not None:
            out["speculative"] = chat.speculative
        return out

    # ---- deltas -> items and events ----------------------------------------------------------

    def _item(self) -> dict[str, Any]:
        return self.output[-1]

    def _whole(self, kind: str) -> Event:
        """``output_item.added`` / ``.done``: the item as it stands (a copy: it grows after)."""
        return kind, {"output_index": len(self.output) - 1, "item": copy.deepcopy(self._item())}

    def _within(self, kind: str, **fields: Any) -> Event:
        """An event about the last item's content: its deltas and ``.done`` events."""
        return kind, {"item_id": self._item()["id"], "output_index": len(self.output) - 1, **fields}

    def _open(self, item: dict[str, Any]) -> list[Event]:
        self.output.append(item)
        self.open = True
        out = [self._whole("response.output_item.added")]
        if item["type"] == "message":  # one output_text part, added empty
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append(self._within("response.content_part.added", content_index=0, part=copy.deepcopy(part)))
        return out

    def _close(self, status: str = "completed") -> list[Event]:
        if not self.open:
            return []
        self.open = False
        item = self._item()
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [
                self._within("response.output_text.done", content_index=0, text=part["text"], logprobs=[]),
                self._within("response.content_part.done", content_index=0, part=copy.deepcopy(part)),
            ]
        else:
            out = [self._within("response.function_call_arguments.done", arguments=item["arguments"])]
        return [*out, self._whole("response.output_item.done")]

    def _apply(self, d: Delta) -> list[Event]:
        ChatFormat.fold(self, d)  # texts, calls, finish and counts, as chat keeps them (the cache reads them)
        out: list[Event] = []
        if d.text:
            if not (self.open and self._item()["type"] == "message"):
                message = {
                    "id": new_id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                }
                out += self._close() + self._open({**message, "content": []})
            self._item()["content"][0]["text"] += d.text
            out.append(self._within("response.output_text.delta", content_index=0, delta=d.text, logprobs=[]))
        for piece in d.tool_calls or []:
            if piece.id is not None:
                call = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": ""}
                out += self._close() + self._open({**call, "call_id": piece.id, "name": piece.name or ""})
            if piece.arguments:
                self._item()["arguments"] += piece.arguments
                out.append(self._within("response.function_call_arguments.delta", delta=piece.arguments))
        if d.finish_reason is not None:
            out += self._close("incomplete" if d.finish_reason == "length" else "completed")
        return out

    def fold(self, d: Delta) -> None:
        self._apply(d)

    def _sse(self, events: list[Event]) -> list[dict[str, str]]:
        out = []
        for kind, fields in events:
            payload = {"type": kind, "sequence_number": self.seq, **fields}
            self.seq += 1
            out.append(
                {
                    "event": kind,
                    "data": sse_json(json.dumps(payload, ensure_ascii=False, separators=(",", ":"))),
                }
            )
        return out

    # ---- what serving calls ------------------------------------------------------------------

    def opening(self, gen: Generation) -> list[Any]:
        snapshot = self.response("in_progress")
        return self._sse(
            [("response.created", {"response": snapshot}), ("response.in_progress", {"response": snapshot})]
        )

    def chunks(self, d: Delta) -> list[Any]:
        return self._sse(self._apply(d))

    async def settle(self, gen: Generation) -> None:
        """Every delta arrived: the finished response, stored when asked to be."""
        status = "incomplete" if self.finish[0] == "length" else "completed"
        self.final = self.response(status, self.usage_of(gen))
        if self.keep is not None:
            await self.keep(self.final)

    def closing(self, gen: Generation) -> list[Any]:
        assert self.final is not None, "settle() comes first"
        kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
        return self._sse([(kind, {"response": self.final})])

    def failure(self, error: dict[str, Any]) -> list[Any]:
        """A fault after the 200: ``response.failed``, its error as OpenAI's response objects carry one."""
        detail = error.get("error") or {}
        failed = {"code": "server_error", "message": detail.get("message", "The server had an error.")}
        return self._sse([("response.failed", {"response": self.response("failed", error=failed)})])

    ending: tuple[Any, ...] = ()  # no [DONE]: the stream ends with its last typed event

    def whole(self, gen: Generation) -> dict[str, Any]:
        assert self.final is not None, "settle() comes first"
        return self.final
