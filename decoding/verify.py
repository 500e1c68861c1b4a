"""Verification of drafted tokens against the target: pure functions, tensors in, tensors out.

Legend (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
  p: draft distribution, q: target distribution, k: drafted tokens per step.
  *accepted*: drafted tokens the target keeps; *recovered*: the token drawn from norm(max(0, q - p))
  at the first rejection; *bonus*: the token drawn from q after all k drafts were accepted.

Each call returns the tokens to append: the accepted drafts followed by exactly one recovered or
bonus token, so every verification emits between 1 and k+1 tokens.
"""

from __future__ import annotations

import torch

from decoding.sampling import sample


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k+1, V] processed logits (penalties applied), any scale
) -> tuple[int, torch.Tensor]:
    """Accept while the target's argmax agrees with the draft. Returns (n_accepted, tokens[n+1])."""
    k = draft_tokens.shape[0]
    target_argmax = target_logits.argmax(-1)  # [k+1]
    agree = (target_argmax[:k] == draft_tokens).int()
    n = int(agree.cumprod(0).sum()) if k else 0
    return n, torch.cat([draft_tokens[:n], target_argmax[n : n + 1]])


def verify_sampling(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V]; None: the drafter is deterministic (prompt lookup)
    target_probs: torch.Tensor,  # [k+1, V]
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor]:
    """Rejection sampling: accept d_i with min(1, q/p); on rejection draw from norm(max(0, q - p)).

    A deterministic drafter proposes with p = one-hot(d_i), so acceptance is q(d_i) and the
    residual is q with d_i removed: still exactly the target distribution.
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k, device=target_probs.device)
    q = target_probs[idx, draft_tokens] if k else target_probs.new_zeros(0)  # [k]
    if draft_probs is None:
        p = torch.ones_like(q)
        p_full = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    else:
        p = draft_probs[idx, draft_tokens]
        p_full = draft_probs
    u = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
    accept = (u * p <= q).int()  # u < q/p without dividing by a possibly-zero p
    n = int(accept.cumprod(0).sum()) if k else 0
    if n < k:
        residual = (target_probs[n] - p_full[n]).clamp_min(0)  # [V]
        total = residual.sum()
        # q == p exactly leaves no residual mass; any draw from q is then correct
        dist = residual / total if total > 0 else target_probs[n]
    else:
        dist = target_probs[k]
    last = sample(dist[None], generator)
    return n, torch.cat([draft_tokens[:n], last])
