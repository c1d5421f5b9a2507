"""Acceptance over the course of one long output: tokens per target pass by position bucket of the new tokens, the
logic behind `benchmarks/bench_long_output.py`.

A reasoning model's output runs to thousands of tokens, so the drafter's context grows while it drafts. Each call
here generates `max_new_tokens` greedy tokens with K drafts every round and records, through `generate()`'s
`round_observer`, how many drafts each round kept; [`position_buckets`] then splits the output into buckets of new
tokens and reports each bucket's tokens per target pass. Every output is checked against plain greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def position_buckets(accepted: Sequence[int], bucket: int, total: int) -> list[dict[str, Any]]:
    """Tokens per target pass by position of the new tokens.

    Args:
        accepted: the drafts each round kept, in order (a round emits `accepted + 1` tokens); the prefill emits the
            first new token in one pass before them, and the tokens after the last round are plain steps.
        bucket: new tokens per bucket.
        total: the new tokens of the output (the last round may be cut at the end).

    Returns:
        One dict per bucket: `start`, `end` (new-token positions), `tokens`, `passes` (the rounds that started in
        the bucket; the prefill counts in the first) and `tokens_per_target_pass`.

    >>> [b["tokens_per_target_pass"] for b in position_buckets([3, 0, 1, 3], bucket=4, total=10)]
    [2.5, 1.5, 2.0]
    """
    counts: dict[int, list[int]] = {}
    position = 1  # the prefill's token
    counts.setdefault(0, [1, 1])
    # a round without drafts (none left to verify at the output's end) is a plain step the observer never sees
    rounds = [*accepted, *([0] * total)]
    for kept in rounds:
        if position >= total:
            break
        made = min(kept + 1, total - position)
        slot = counts.setdefault(position // bucket, [0, 0])
        slot[0] += made
        slot[1] += 1
        position += made
    return [
        {
            "start": b * bucket,
            "end": min((b + 1) * bucket, total),
            "tokens": tokens,
            "passes": passes,
            "tokens_per_target_pass": tokens / passes if passes else None,
        }
        for b, (tokens, passes) in sorted(counts.items())
    ]


@torch.no_grad()
def long_output_run(
    target,
    head,
    prompt: torch.LongTensor,
    settings: dict[str, Any],
    reference: torch.LongTensor | None = None,
) -> dict[str, Any]:
    """One long greedy output of `prompt` drafted by `head` with `settings` (`max_new_tokens`,
    `num_assistant_tokens`, `drafter_window`, `bucket`): its buckets ([`position_buckets`]), overall tokens per target
    pass, and whether it equals `reference` (plain greedy of the same call; computed when None)."""
    new = int(settings["max_new_tokens"])
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
    if reference is None:
        reference = target.generate(prompt, **kw)
    rounds: list[int] = []
    out = target.generate(
        prompt,
        assistant_model=head,
        num_assistant_tokens=int(settings["num_assistant_tokens"]),
        assistant_confidence_threshold=0.0,  # K every round: acceptance, not the rule, is measured
        drafter_window=settings.get("drafter_window"),
        round_observer=lambda confidences, kept: rounds.append(int(kept)),
        **kw,
    )
    stats = head.last_generation_stats
    return {
        "drafter_window": settings.get("drafter_window"),
        "identical": bool(torch.equal(out, reference)),
        "tokens_per_target_pass": stats.tokens_per_target_pass,
        "buckets": position_buckets(rounds, int(settings["bucket"]), new),
        "reference": reference,
    }


__all__ = ["long_output_run", "position_buckets"]
