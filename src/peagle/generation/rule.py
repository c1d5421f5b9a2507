"""The drafting rule, pure: how many drafts a round verifies, from the head's calibrated probabilities and the
cost of verifying n tokens (no timing, no files; [`cost`] measures and caches the costs).

A round that verifies k drafts emits, in expectation,

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} p_j

tokens (p_j: the calibrated probability that draft j is accepted given drafts 1..j-1 were), and costs
`cost(k + 1)` seconds of target time plus the drafter's own pass.  [`choose_num_drafts`] picks the k in 0..K that
maximises E(k) / (cost(k + 1) + drafter cost); k = 0 makes the round a plain step.  A batch verifies one k for
all its rows ([`choose_batch_num_drafts`]: the rows' E(k) summed, the cost of B x (k + 1) tokens).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


# ---------------------------------------------------------------------------------------------- the rule
def expected_tokens(probs: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} p_j: expected tokens a round verifying the first k drafts emits.

    >>> expected_tokens([0.5, 0.5], 2)
    1.75
    """
    return 1.0 + sum(chain_gains(probs[:k]))


def chain_gains(probs: Sequence[float]) -> list[float]:
    """The expected tokens each further draft of a chain adds: the running products `p_1, p_1 p_2, ...` (a
    draft counts only if every draft before it was accepted).

    >>> chain_gains([0.5, 0.5, 1.0])
    [0.5, 0.25, 0.25]
    """
    run, gains = 1.0, []
    for p in probs:
        run *= float(p)
        gains.append(run)
    return gains


def choose_num_drafts(
    probs: Sequence[float], verify_seconds: Sequence[float], drafter_seconds: float = 0.0
) -> int:
    """The k in 0..K maximising expected tokens per second of one row's round ([`choose_batch_num_drafts`] with
    one row).

    >>> choose_num_drafts([0.9, 0.9, 0.1], [1.0, 1.1, 1.2, 1.3])
    2
    >>> choose_num_drafts([0.9, 0.9], [1.0, 3.0, 3.0])
    0
    """
    return choose_batch_num_drafts([probs], verify_seconds, drafter_seconds)


def choose_batch_num_drafts(
    rows: Sequence[Sequence[float]], verify_seconds: Sequence[float], drafter_seconds: float = 0.0
) -> int:
    """The one k in 0..K every row of a batched round verifies, maximising the batch's expected tokens per second.

    Args:
        rows: per row, `[K]` calibrated acceptance probabilities of its drafts (conditional on the earlier
            drafts being accepted).  Every row verifies the same number of drafts (one target pass over
            `B x (k + 1)` tokens), so the round's expected tokens are the rows' `E(k)` summed.
        verify_seconds: `[K + 1]` seconds to verify n = 1..K+1 tokens per row, for this batch size
            (`verify_seconds[n - 1]`).
        drafter_seconds: the drafter's cost this round (paid whatever k is).

    Returns:
        k; 0 means verify no draft (a plain step).  Ties go to the smaller k.

    >>> choose_batch_num_drafts([[0.9, 0.9], [0.1, 0.1]], [1.0, 1.3, 1.9])
    1
    """
    return choose_batch_tree_size([chain_gains(row) for row in rows], verify_seconds, drafter_seconds)


def choose_batch_tree_size(
    gains: Sequence[Sequence[float]], verify_seconds: Sequence[float], drafter_seconds: float = 0.0
) -> int:
    """The one n in 0..N of draft nodes every row of a batched round verifies, maximising expected tokens per
    second: the rule for chains and trees alike.

    Args:
        gains: per row, `[N]` the expected tokens each further draft adds, in the order drafts are added: a chain's
            running products `p_1, p_1 p_2, ...`, a tree's node values (parents first,
            [`tree.DraftTree.gains`]).  A round verifying the first n drafts emits `1 + sum(gains[:n])` tokens
            in expectation.
        verify_seconds: seconds to verify n = 1..N+1 tokens per row for this batch (`verify_seconds[n - 1]`).
        drafter_seconds: the drafter's cost this round (paid whatever n is).

    Returns:
        n; 0 means verify no draft (a plain step).  Ties go to the smaller n.

    >>> choose_batch_tree_size([[0.9, 0.5, 0.5, 0.1]], [1.0, 1.1, 1.2, 1.3, 2.0])
    3
    """
    depth = min((len(g) for g in gains), default=0)
    depth = min(depth, len(verify_seconds) - 1)
    best_n, top = 0, -1.0
    total = float(len(gains))
    for n in range(depth + 1):
        if n > 0:
            total += sum(float(g[n - 1]) for g in gains)
        rate = total / (verify_seconds[n] + drafter_seconds)
        if rate > top * (1 + 1e-9):
            best_n, top = n, rate
    return best_n


def best_rate(probs: Sequence[float], verify_seconds: Sequence[float], drafter_seconds: float = 0.0) -> float:
    """Expected tokens per second at [`choose_num_drafts`]'s k."""
    return best_batch_rate([probs], verify_seconds, drafter_seconds)


def best_batch_rate(
    rows: Sequence[Sequence[float]], verify_seconds: Sequence[float], drafter_seconds: float = 0.0
) -> float:
    """Expected tokens per second of a batched round at [`choose_batch_num_drafts`]'s k."""
    k = choose_batch_num_drafts(rows, verify_seconds, drafter_seconds)
    return sum(expected_tokens(r, k) for r in rows) / (verify_seconds[k] + drafter_seconds)


# ---------------------------------------------------------------------------------------------- calibration
def calibrated_probability(calibration: dict[str, Any] | None, depth: int, confidence: float) -> float:
    """Map the head's confidence in its draft at `depth` to an acceptance probability.

    `calibration` is a head's `config.draft_calibration`: `{"method": "isotonic", "x": [[...] per depth],
    "y": [[...] per depth]}`, a monotone piecewise-linear map per depth (the last depth's map serves deeper
    ones; flat beyond its ends).  None: the raw confidence.  Plain Python: it runs for every draft of a round.

    >>> calibrated_probability({"x": [[0.2, 0.6]], "y": [[0.1, 0.5]]}, 3, 0.4)
    0.3
    """
    if not calibration:
        return float(confidence)
    xs, ys = calibration["x"], calibration["y"]
    d = min(depth, len(xs) - 1)
    x, y = xs[d], ys[d]
    c = float(confidence)
    if c <= x[0]:
        return float(y[0])
    if c >= x[-1]:
        return float(y[-1])
    i = bisect.bisect_right(x, c)
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return round(y0 + (c - x0) / (x1 - x0) * (y1 - y0), 12) if x1 > x0 else float(y0)


def calibrated_probabilities(calibration: dict[str, Any] | None, confidences: Sequence[float]) -> list[float]:
    """The acceptance probabilities of one round's drafts: depth d's map applied to the d-th confidence.

    >>> calibrated_probabilities({"x": [[0.0, 1.0], [0.0, 1.0]], "y": [[0.0, 0.5], [0.0, 0.25]]}, [1.0, 1.0])
    [0.5, 0.25]
    """
    return [calibrated_probability(calibration, d, c) for d, c in enumerate(confidences)]


@dataclass
class AcceptanceCorrection:
    """Per-depth correction of the calibrated probabilities from the rounds one generation has verified.

    The calibration describes the head on its calibration text; the prompt at hand may be easier (code) or
    harder, and the rule verifies deep drafts exactly when their predicted probabilities are high, where any
    calibration error counts most.  Each verified round tells, for every depth up to the first rejection, the
    predicted probability and whether the draft was accepted; depth d's probabilities are multiplied by
    ``(accepted_d + prior) / (predicted_d + prior)`` (1 until evidence accumulates; capped at 1 overall).

    >>> c = AcceptanceCorrection(prior=1.0)
    >>> c.observe([0.8, 0.5], accepted=0)  # the first draft was rejected
    >>> [round(p, 4) for p in c.apply([0.8, 0.5])]
    [0.4444, 0.5]
    """

    prior: float = 2.0
    predicted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def factor(self, depth: int) -> float:
        if depth >= len(self.predicted):
            return 1.0
        return (self.accepted[depth] + self.prior) / (self.predicted[depth] + self.prior)

    def apply(self, probs: Sequence[float]) -> list[float]:
        return [min(1.0, p * self.factor(d)) for d, p in enumerate(probs)]

    def observe(self, probs: Sequence[float], accepted: int) -> None:
        """One verified round: `probs` of the drafts it verified, as predicted *before* this correction (the
        factor compares the uncorrected predictions with the outcomes; fed corrected ones, it would settle at
        the square root of the right factor), and `accepted` of them kept."""
        for d in range(min(len(probs), accepted + 1)):  # depths past the first rejection were not tested
            while d >= len(self.predicted):
                self.predicted.append(0.0)
                self.accepted.append(0.0)
            self.predicted[d] += float(probs[d])
            self.accepted[d] += 1.0 if d < accepted else 0.0


__all__ = [
    "AcceptanceCorrection",
    "best_batch_rate",
    "best_rate",
    "calibrated_probabilities",
    "calibrated_probability",
    "chain_gains",
    "choose_batch_num_drafts",
    "choose_batch_tree_size",
    "choose_num_drafts",
    "expected_tokens",
]
