"""Per-depth calibration of a head's draft probabilities (what the cost-aware rule multiplies).

The head's softmax probability of its own draft is not the probability that the target accepts it: parallel
slots and the autoregressive unroll are over- or under-confident by depth.  [`fit_draft_calibration`] runs the
head inside `generate()` on held-out prompts with K drafts every round, records for each round the head's
confidence in every draft and how many the target accepted, and fits per depth a monotone (isotonic) map from
confidence to the *conditional* acceptance probability (draft d is only judged in rounds whose drafts before d
were all accepted, exactly the p_d the rule multiplies).  Half of the rounds fit the map, the other half report
the expected calibration error (ECE) before and after.  The result goes into `head.config.draft_calibration`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..configuration_peagle import check_draft_calibration
from .rule import calibrated_probability

MIN_SAMPLES = 40
"""Depths judged in fewer rounds than this share the previous depth's map."""


def isotonic_fit(
    x: Sequence[float], y: Sequence[float], max_knots: int = 24
) -> tuple[list[float], list[float]]:
    """A non-decreasing piecewise-linear map from `x` to the mean of `y` (pool-adjacent-violators on at most
    `max_knots` quantile bins).

    >>> isotonic_fit([0.1, 0.2, 0.3, 0.4], [0, 1, 0, 1], max_knots=4)
    ([0.1, 0.25, 0.4], [0.0, 0.5, 1.0])
    """
    if len(x) == 0:
        raise ValueError("isotonic_fit needs at least one sample.")
    order = sorted(range(len(x)), key=lambda i: x[i])
    xs = [float(x[i]) for i in order]
    ys = [float(y[i]) for i in order]
    n = len(xs)
    bins = max(1, min(max_knots, n))
    blocks: list[list[float]] = []  # [sum_x, sum_y, weight]
    for b in range(bins):
        lo, hi = b * n // bins, (b + 1) * n // bins
        if hi > lo:
            blocks.append([sum(xs[lo:hi]), sum(ys[lo:hi]), float(hi - lo)])
    merged: list[list[float]] = []
    for blk in blocks:
        merged.append(blk)
        while len(merged) > 1 and merged[-2][1] / merged[-2][2] > merged[-1][1] / merged[-1][2]:
            last = merged.pop()
            for j in range(3):
                merged[-1][j] += last[j]
    return [round(b[0] / b[2], 6) for b in merged], [round(b[1] / b[2], 6) for b in merged]


def expected_calibration_error(conf: Sequence[float], accepted: Sequence[float], bins: int = 10) -> float:
    """ECE: the sample-weighted mean |accuracy - confidence| over `bins` equal-width confidence bins.

    >>> expected_calibration_error([0.9, 0.9, 0.1, 0.1], [1, 1, 0, 0])
    0.1
    """
    if len(conf) == 0:
        return 0.0
    groups: dict[int, list[tuple[float, float]]] = {}
    for c, a in zip(conf, accepted):
        groups.setdefault(min(int(float(c) * bins), bins - 1), []).append((float(c), float(a)))
    total = 0.0
    for items in groups.values():
        mc = sum(c for c, _ in items) / len(items)
        ma = sum(a for _, a in items) / len(items)
        total += abs(ma - mc) * len(items)
    return round(total / len(conf), 10)


def round_samples(rounds: Sequence[tuple[Sequence[float], int]]) -> list[list[tuple[float, int]]]:
    """Per depth, `(confidence, accepted)` of every draft judged: depth d counts in rounds that drafted it and
    accepted all drafts before it.

    >>> round_samples([([0.9, 0.5, 0.2], 1), ([0.8, 0.7], 2)])
    [[(0.9, 1), (0.8, 1)], [(0.5, 0), (0.7, 1)]]
    """
    per_depth: list[list[tuple[float, int]]] = []
    for confidences, accepted in rounds:
        for d, c in enumerate(confidences):
            if d > accepted:
                break
            while len(per_depth) <= d:
                per_depth.append([])
            per_depth[d].append((float(c), int(d < accepted)))
    return per_depth


def fit_from_rounds(rounds: Sequence[tuple[Sequence[float], int]], holdout: float = 0.5) -> dict[str, Any]:
    """Fit the per-depth isotonic maps on part of the rounds; report ECE before/after on the rest.

    Returns `{"calibration": {...config value...}, "report": {"ece_before": [...], "ece_after": [...],
    "samples": [...]}}`; every other round is held out (`holdout=0.5`).
    """
    step = max(2, round(1 / holdout)) if 0 < holdout < 1 else 0
    fit_rounds = [r for i, r in enumerate(rounds) if not step or i % step != 0]
    held_rounds = [r for i, r in enumerate(rounds) if step and i % step == 0]
    fit, held = round_samples(fit_rounds), round_samples(held_rounds)
    xs, ys = [], []
    for samples in fit:
        if len(samples) < MIN_SAMPLES:
            break
        x, y = isotonic_fit([c for c, _ in samples], [a for _, a in samples])
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ValueError(
            f"too few drafting rounds to calibrate ({len(fit[0]) if fit else 0} first drafts; need {MIN_SAMPLES}): "
            "use more or longer prompts."
        )
    calibration = {"method": "isotonic", "x": xs, "y": ys}
    report: dict[str, list] = {"ece_before": [], "ece_after": [], "samples": []}
    for d, samples in enumerate(held):
        conf = [c for c, _ in samples]
        acc = [a for _, a in samples]
        mapped = [calibrated_probability(calibration, d, c) for c in conf]
        report["ece_before"].append(expected_calibration_error(conf, acc))
        report["ece_after"].append(expected_calibration_error(mapped, acc))
        report["samples"].append(len(samples))
    return {"calibration": calibration, "report": report}


@torch.no_grad()
def collect_rounds(
    head: Any,
    target: Any,
    prompts: Sequence[torch.Tensor],
    num_speculative_tokens: int | None = None,
    max_new_tokens: int = 128,
    progress: bool = True,
) -> list[tuple[list[float], int]]:
    """Greedy `generate()` with K drafts every round on each prompt `(1, T)`; per round, the head's confidence
    in each draft and the number of drafts the target accepted."""
    k = num_speculative_tokens or head.config.num_speculative_tokens
    rounds: list[tuple[list[float], int]] = []
    for ids in tqdm(prompts, desc="calibration rounds", disable=not progress):
        target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=head,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
            round_observer=lambda confidences, accepted: rounds.append((confidences, accepted)),
        )
    return rounds


def fit_draft_calibration(
    head: Any,
    target: Any,
    prompts: Sequence[torch.Tensor],
    num_speculative_tokens: int | None = None,
    max_new_tokens: int = 128,
    progress: bool = True,
) -> dict[str, Any]:
    """Fit `head.config.draft_calibration` on held-out prompts (never evaluation sets) and return
    `{"calibration", "report"}`; the caller stores `calibration` in the head's config."""
    rounds = collect_rounds(head, target, prompts, num_speculative_tokens, max_new_tokens, progress)
    return fit_from_rounds(rounds)


def prompts_of_examples(examples: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """`(1, T)` prompt ids of self-distilled examples: each example's tokens before its first supervised one."""
    prompts = []
    for ex in examples:
        mask = list(ex["loss_mask"])
        cut = mask.index(1) if 1 in mask else len(mask)
        if cut > 0:
            prompts.append(torch.tensor([list(ex["input_ids"])[:cut]], dtype=torch.long))
    return prompts


def calibrate_head_folder(
    head_dir: str,
    examples: str,
    target: str = "default",
    limit: int = 32,
    skip: int = 0,
    max_new_tokens: int = 128,
    num_speculative_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
    head_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Fit the calibration of the head in `head_dir` on the prompts of held-out `examples` (a shard folder or
    JSONL; examples `skip`..`skip+limit`) and store it in `head_dir/config.json` (`draft_calibration`, with the
    held-out ECE report and the data it came from).  Returns `{"calibration", "report"}`."""
    import json
    from pathlib import Path

    from ..data.shards import load_examples
    from ..modeling_peagle import PEagleDrafter
    from ..targets import load_target

    rows = load_examples(examples)[skip : skip + limit]
    prompts = prompts_of_examples(rows)
    if not prompts:
        raise ValueError(f"no prompts in {examples} (examples {skip}..{skip + limit}).")
    model, _ = load_target(target, dtype=dtype)
    head = PEagleDrafter.from_pretrained(head_dir, dtype=head_dtype or dtype).attach_target(model).eval()
    result = fit_draft_calibration(head, model, prompts, num_speculative_tokens, max_new_tokens)
    path = Path(head_dir) / "config.json"
    config = json.loads(path.read_text())
    config["draft_calibration"] = dict(
        result["calibration"],
        report=result["report"],
        data={
            "examples": str(examples),
            "skip": skip,
            "limit": limit,
            "max_new_tokens": max_new_tokens,
            "target_dtype": str(dtype).replace("torch.", ""),
            "head_dtype": str(head_dtype or dtype).replace("torch.", ""),
        },
    )
    check_draft_calibration(config["draft_calibration"])  # what the head will read back, before writing it
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a reader sees the old config or the new one, never half of it
    return result


__all__ = [
    "calibrate_head_folder",
    "collect_rounds",
    "prompts_of_examples",
    "expected_calibration_error",
    "fit_draft_calibration",
    "fit_from_rounds",
    "isotonic_fit",
    "round_samples",
]
