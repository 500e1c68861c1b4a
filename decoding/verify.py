"""Verification of drafted tokens against the target: pure functions, tensors in, tensors out.

Legend (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
  p: draft distribution, q: target distribution, k: drafted tokens per step.
  *accepted*: drafted tokens the target keeps; *recovered*: the token drawn from norm(max(0, q - p))
  at the first rejection; *bonus*: the token drawn from q after all k drafts were accepted.

Each call returns ``(n, tokens)`` as device tensors: ``n`` accepted drafts (0-d) and ``tokens`` [k+1],
whose first n+1 entries are the accepted drafts followed by exactly one recovered or bonus token. Nothing
here reads a tensor back to the host, so a step has a single sync: the caller's read of both at once.
"""

from __future__ import annotations

import torch

from decoding.sampling import sample


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k+1, V] processed logits (penalties applied), any scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the target's argmax agrees with the draft.

    Where they agree the draft token *is* the argmax, so the emitted tokens are argmax[: n+1].
    """
    k = draft_tokens.shape[0]
    target_argmax = target_logits.argmax(-1)  # [k+1]
    n = (target_argmax[:k] == draft_tokens).int().cumprod(0).sum()  # [] leading agreements
    return n, target_argmax


def verify_greedy_batch(
    drafts: torch.Tensor,  # [B, K] drafted tokens, padded past each row's k with a token id never drawn (-1)
    target_logits: torch.Tensor,  # [B, K+1, V] processed logits
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_greedy for B rows at once: ``n`` [B] leading agreements (a padded draft never agrees,
    so a row stops at its own k) and the target's argmax [B, K+1]."""
    K = drafts.shape[1]
    target_argmax = target_logits.argmax(-1)  # [B, K+1]
    n = (target_argmax[:, :K] == drafts).int().cumprod(1).sum(1)  # [B]
    return n, target_argmax


def verify_sampling(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V]; None: the drafter is deterministic (prompt lookup)
    target_probs: torch.Tensor,  # [k+1, V]
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling: accept d_i with min(1, q/p); on rejection draw from norm(max(0, q - p)).

    A deterministic drafter proposes with p = one-hot(d_i), so acceptance is q(d_i) and the
    residual is q with d_i removed: still exactly the target distribution.
    """
    k, V = draft_tokens.shape[0], target_probs.shape[-1]
    idx = torch.arange(k, device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, V).to(target_probs.dtype)  # [k, V]
    q = target_probs[idx, draft_tokens]  # [k]
    p = draft_probs[idx, draft_tokens]  # [k]
    u = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
    n = (u * p < q).int().cumprod(0).sum()  # [] u < q/p, without dividing by p
    # a zero row after the k drafts makes the bonus case (n == k) the same formula: residual = q[k]
    p_pad = torch.cat([draft_probs, draft_probs.new_zeros(1, V)])  # [k+1, V]
    residual = (target_probs[n] - p_pad[n]).clamp_min(0)  # [V]
    total = residual.sum()
    # q == p exactly leaves no residual mass; any draw from q is then correct
    dist = torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs[n])
    last = sample(dist[None], generator)  # [1]
    tokens = torch.cat([draft_tokens, last])  # [k+1]
    tokens[n] = last[0]
    return n, tokens
