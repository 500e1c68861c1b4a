"""Turning logits into the distribution a request samples from.

The same function shapes draft and target logits: speculative sampling is only lossless when the
draft distribution p and the target distribution q are both the *processed* distributions
(temperature, penalties, top-k, top-p) of their models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [T, V]
    counts: torch.Tensor,  # [V] completion-token counts before position 0
    window: torch.Tensor,  # [T-1] tokens that sit between positions (drafted tokens)
    params: SamplingParams,
    prompt_seen: torch.Tensor | None = None,  # [V] bool: in the prompt (repetition_penalty)
) -> torch.Tensor:
    """OpenAI presence/frequency penalties over generated tokens, and vLLM's repetition penalty over
    the prompt's and the generated tokens (CTRL's: a seen token's logit divided by it where positive,
    multiplied where negative), per position of a window.

    Row t sees the counts plus ``window[:t]``: a verification step scores k+1 positions whose
    histories differ by the drafted tokens before them. Without ``prompt_seen`` (a draft's rows) the
    repetition penalty sees the generated tokens alone.
    """
    if not params.penalised:
        return logits
    T, V = logits.shape
    per_pos = counts.to(logits.dtype).expand(T, V).clone()  # [T, V]
    if T > 1:
        onehot = torch.nn.functional.one_hot(window[: T - 1], V).to(logits.dtype)  # [T-1, V]
        per_pos[1:] += onehot.cumsum(0)
    seen = per_pos > 0  # [T, V]
    out = logits - params.frequency_penalty * per_pos - params.presence_penalty * seen.to(logits.dtype)
    if params.repetition_penalty != 1:
        if prompt_seen is not None:
            seen = seen | prompt_seen.to(seen.device)
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] logits -> [T, V] float32 probabilities after temperature, top-k, top-p and min-p.

    Stable for any temperature > 0 and top_p > 0: logits are shifted so each row's maximum is 0
    before dividing (a tiny temperature then sends the others to -inf, never inf - inf = NaN: the
    distribution becomes the greedy one-hot, ties shared), and top-p always keeps the most likely token.
    """
    logits = logits.float()
    if params.temperature > 0:
        # below float32's smallest normal the divisor itself would round to 0 (then 0 / 0)
        temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
        logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the mass strictly before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token stays, whatever rounding did to its mass
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:  # vLLM's min-p, after top-k/top-p: the likeliest token always stays
        keep = probs >= params.min_p * probs.amax(-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[T, V] -> [T] one draw per row."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Scored:
    """Tokens' log-probabilities under the raw model distribution (as OpenAI and vLLM report them),
    still on the device: the [T, V] log-softmax they came from is not kept."""

    chosen: torch.Tensor  # [T] float32, each token's logprob
    top_values: torch.Tensor  # [T, N] float32, the N best logprobs, best first
    top_ids: torch.Tensor  # [T, N] long, their token ids

    def read(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """(logprob, [(token_id, logprob)] best first) per token, on the host."""
        chosen = self.chosen.tolist()
        if self.top_ids.shape[-1] == 0:
            return [(c, []) for c in chosen]
        vals, ids = self.top_values.tolist(), self.top_ids.tolist()
        return [(c, list(zip(ids[t], vals[t], strict=True))) for t, c in enumerate(chosen)]


def score(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> Scored:
    """``tokens`` [T] scored by ``logits`` [T, V] (row t is the distribution token t was drawn from),
    with the ``top_n`` best alternatives of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    chosen = lp.gather(-1, tokens[:, None]).squeeze(-1)  # [T]
    top = torch.topk(lp, top_n, dim=-1)  # [T, N]
    return Scored(chosen, top.values, top.indices)


def logprobs_of(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top_n: int,  # [T, V], [T]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the raw model distribution (as OpenAI and vLLM report them)."""
    return score(logits, tokens, top_n).read()
