"""COD (conditional drop) sampling of parallel training elements.

P-EAGLE trains every anchor position ``a`` at depths ``d = 0 .. K-1``: element ``(a, d)`` predicts the token
``d + 1`` steps past the anchor's next token.  Training all ``n * K`` elements is too costly, so COD (from PARD)
keeps all depth-0 elements and, at each deeper level, a random subset of the anchors whose previous-depth
element was kept.  The kept set therefore forms *nested chains*: ``(a, d)`` kept implies ``(a, d - 1)`` kept,
which is what the attention rule needs (an element attends to its own chain).
"""

from __future__ import annotations

import math

import torch


def cod_counts(
    num_anchors: int, num_parallel_positions: int, ratio: float, min_ratio: float = 0.0
) -> list[int]:
    """How many anchors COD keeps at each depth when all `num_anchors` anchors are eligible.

    Depth 0 keeps all of them; depth ``d >= 1`` keeps ``round(max(ratio**d, min_ratio) * num_anchors)``, capped by
    the previous depth's count (rounding half up).

    Example:

    >>> cod_counts(10, 4, ratio=0.5, min_ratio=0.2)
    [10, 5, 3, 2]
    >>> cod_counts(10, 3, ratio=1.0)
    [10, 10, 10]
    """
    _check_ratios(ratio, min_ratio)
    counts = [int(num_anchors)] if num_parallel_positions > 0 else []
    for d in range(1, num_parallel_positions):
        counts.append(min(counts[-1], _round_half_up(max(ratio**d, min_ratio) * num_anchors)))
    return counts


def cod_sample(
    num_anchors: int,
    num_parallel_positions: int,
    ratio: float,
    min_ratio: float = 0.0,
    *,
    generator: torch.Generator | None = None,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample which training elements ``(a, d)`` COD keeps.

    Args:
        num_anchors: n, the number of anchor positions.
        num_parallel_positions: K_train, the number of depths (``0 .. K-1``; depth 0 is the real slot).
        ratio: r, the keep ratio per depth (``r**d`` of the anchors at depth d).
        min_ratio: r_min, the floor of the keep ratio.
        generator: the random source (a CPU `torch.Generator`); pass one for reproducible plans.
        eligible: optional `(K, n)` bool; ``eligible[d, a]`` False forbids keeping ``(a, d)`` for ``d >= 1`` (e.g. its
            label is past the end of the sequence or outside the response).  Depth 0 is always kept in full.  The
            count at depth d is then ``round(max(r**d, r_min) * eligible[d].sum())``, capped by the pool size.

    Returns:
        `keep`, a `(K, n)` bool tensor on the CPU: ``keep[0]`` is all True and ``keep[d]`` implies ``keep[d - 1]``
        (nested chains); ``keep[d]`` holds exactly `cod_counts(...)[d]` True entries when nothing is ineligible.

    Example (n = 10 anchors, K = 4, r = 0.5, r_min = 0.2 -> counts 10, 5, 3, 2):

    >>> g = torch.Generator().manual_seed(0)
    >>> keep = cod_sample(10, 4, 0.5, 0.2, generator=g)
    >>> keep.sum(1).tolist()
    [10, 5, 3, 2]
    >>> bool((keep[1:] <= keep[:-1]).all())  # (a, d) kept => (a, d-1) kept
    True
    """
    _check_ratios(ratio, min_ratio)
    if num_anchors < 0 or num_parallel_positions < 1:
        raise ValueError(
            "cod_sample needs num_anchors >= 0 and num_parallel_positions >= 1, got "
            f"{num_anchors} and {num_parallel_positions}."
        )
    keep = torch.zeros(num_parallel_positions, num_anchors, dtype=torch.bool)
    keep[0] = True
    if eligible is not None:
        eligible = torch.as_tensor(eligible, dtype=torch.bool).cpu()
        if eligible.shape != (num_parallel_positions, num_anchors):
            raise ValueError(
                f"eligible has shape {tuple(eligible.shape)}; "
                f"expected ({num_parallel_positions}, {num_anchors})."
            )
    for d in range(1, num_parallel_positions):
        pool = keep[d - 1] if eligible is None else keep[d - 1] & eligible[d]
        base = num_anchors if eligible is None else int(eligible[d].sum())
        candidates = pool.nonzero().flatten()
        count = min(candidates.numel(), _round_half_up(max(ratio**d, min_ratio) * base))
        if count == 0:
            break
        if count < candidates.numel():
            candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
        keep[d, candidates] = True
    return keep


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5 + 1e-9))


def _check_ratios(ratio: float, min_ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"COD ratios must lie in [0, 1]; got ratio={ratio}, min_ratio={min_ratio}.")


__all__ = ["cod_counts", "cod_sample"]
