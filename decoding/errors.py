"""The engine's exceptions. The gateway maps each to one OpenAI error in one place.

EngineError
├── UnknownModel          -> 404 model_not_found
├── PromptTooLong         -> 400 context_length_exceeded
├── EngineOverloaded      -> 429/503 with Retry-After
├── EngineStopped         -> 503
├── NoFreeSlot            (internal: every KV slot is taken; the request waits in the queue)
└── ModelLoadError
    └── VocabMismatch     (a draft whose vocabulary differs from its target's)
"""

from __future__ import annotations


class EngineError(Exception):
    pass


class UnknownModel(EngineError):
    def __init__(self, model: str, available: list[str]):
        super().__init__(f"The model '{model}' does not exist. Available: {', '.join(available) or 'none'}")
        self.model = model


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_tokens: int | None, context: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context = context
        super().__init__(self.describe("messages"))

    def describe(self, prompt: str) -> str:
        """OpenAI's wording, naming the request's ``prompt`` parameter (messages, or a completion's
        prompt); ``max_tokens`` None: the request set none, and the prompt alone fills the context."""
        if self.max_tokens is None:
            return (
                f"This model's maximum context length is {self.context} tokens. However, your {prompt} "
                f"resulted in {self.prompt_tokens} tokens. Please reduce the length of the {prompt}."
            )
        return (
            f"This model's maximum context length is {self.context} tokens. However, you requested "
            f"{self.prompt_tokens + self.max_tokens} tokens ({self.prompt_tokens} in the {prompt}, "
            f"{self.max_tokens} in the completion). Please reduce the length of the {prompt} or completion."
        )


class EngineOverloaded(EngineError):
    def __init__(self, queued: int):
        super().__init__(f"The server is overloaded ({queued} requests waiting); please retry shortly.")
        self.queued = queued


class EngineStopped(EngineError):
    pass


class NoFreeSlot(EngineError):
    def __init__(self) -> None:
        super().__init__("every KV-cache slot is taken")


class ModelLoadError(EngineError):
    pass


class VocabMismatch(ModelLoadError):
    def __init__(self, target: str, draft: str, detail: str):
        super().__init__(
            f"draft model '{draft}' cannot speculate for target '{target}': their vocabularies differ ({detail})"
        )


class InvalidParameter(ValueError):
    """A request parameter the engine refuses (a grammar that does not compile, a token id outside
    the vocabulary); ``param`` names it for the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
