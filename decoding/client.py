"""The engine as its clients see it (after vLLM's ``EngineClient``): the gateway depends on this alone.

No torch here, as in ``decoding.params``: importing the gateway must not load the model stack.

``submit(request)`` either refuses at once, raising one of ``decoding.errors`` (``UnknownModel``,
``PromptTooLong``, ``EngineOverloaded``, ``EngineStopped``) or ``ValueError``
(``decoding.errors.InvalidParameter``: an empty prompt, a bad logit_bias id), or returns the
request's stream: one ``StepOutput`` per verification step (``token_ids`` accepted in that step; the
last has ``finish_reason`` and ``stats``; the first has ``prompt_logprobs`` where the request's
``SamplingParams.prompt_logprobs`` asked for them). Because the refusal is raised by ``submit``
itself, a caller that submits before it answers never has to take back a 200. Closing the stream
(``aclose``) before the last step aborts the request within one step; a stream must be closed or run
to its end.
"""

from __future__ import annotations

from typing import Any, Protocol

from decoding.params import GenerationRequest, StepOutput

# A Hugging Face tokenizer (chat template, encode, decode); typed loosely so this module needs no
# transformers import.
Tokenizer = Any


class StepStream(Protocol):
    """One submitted request's steps. ``aclose`` leaves early and aborts the request."""

    def __aiter__(self) -> StepStream: ...

    async def __anext__(self) -> StepOutput: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    @property
    def model_names(self) -> list[str]: ...

    def tokenizer(self, model: str) -> Tokenizer: ...  # raises UnknownModel

    def max_context(self, model: str) -> int: ...  # prompt plus completion tokens; raises UnknownModel

    # the request with its grammar compiled off the event loop (raises InvalidParameter): submit that
    async def prepare(self, request: GenerationRequest) -> GenerationRequest: ...

    def submit(self, request: GenerationRequest) -> StepStream: ...

    @property
    def queue_depth(self) -> int: ...  # requests waiting to start (metrics)

    @property
    def active(self) -> int: ...  # requests being decoded (metrics)

    def shutdown(self, timeout: float = 5.0) -> None: ...
