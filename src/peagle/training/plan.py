"""Planning the training elements of an example: COD sampling, supervision, partitioning, drafter inputs.

An example of T tokens has anchors ``a = 0 .. T-3`` and depths ``d = 0 .. K_train-1``; element ``(a, d)``
predicts label ``x_{a+d+2}`` (docs/DESIGN.md section 4).  [`plan_example`] keeps the depth-0 elements and a COD
sample of the deeper ones ([`cod_sample`]), marks the supervised ones (label in the response and in the draft
vocabulary) and splits them into segments ([`partition_plan`]).  [`segment_rows`] lays the elements of one
segment out as `(B, E)` rows for a batch, and [`parallel_drafter_inputs`] turns rows into `PEagleDrafter.forward`
keyword arguments.  Element inputs: ``(a, 0)`` = token ``x_{a+1}``, features ``f_a``, position ``a``; ``(a, d >= 1)``
= parallel slot (mask embedding, ``fc(mask_hidden)``), position ``a + d``.

COD draws are seeded per example by [`cod_seed`] (run seed, optimiser step, the example's tokens), so DDP,
single-process and resumed runs of the same global batch draw the same elements.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .cod import cod_sample
from .masks import PEagleMaskTemplate
from .partition import Segment, partition_plan


@dataclass
class ExamplePlan:
    """The training elements of one example and their partition.

    Attributes:
        length: T, tokens of the example (no padding).
        num_anchors: n = max(T - 2, 0); anchors ``0..n-1`` (each has a depth-0 label ``x_{a+2}``).
        anchor, depth: `(E,)` coordinates of the kept elements, depth-major.
        supervised: `(E,)` bool, the element's label is in the response and in the draft vocabulary.
        segments: the S [`Segment`]s.
    """

    length: int
    num_anchors: int
    anchor: torch.Tensor
    depth: torch.Tensor
    supervised: torch.Tensor
    segments: list[Segment]

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())


def plan_example(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    in_draft_vocab: torch.Tensor,
    num_parallel_positions: int,
    cod_ratio: float,
    cod_min_ratio: float,
    num_segments: int = 1,
    *,
    generator: torch.Generator | None = None,
    template: PEagleMaskTemplate | None = None,
    balance: bool = True,
) -> ExamplePlan:
    """Plan the training elements of one example.

    Args:
        input_ids: `(T,)` tokens (no padding).
        loss_mask: `(T,)` 1 where a token is a response token (a supervised label).
        in_draft_vocab: `(V,)` bool, the head's `t2d`.
        num_parallel_positions: K_train.
        cod_ratio, cod_min_ratio: COD; parallel elements are only sampled where their chain still reaches a
            supervised label (prompt-only chains are never built).
        num_segments: S.
        generator: COD's random source.
        template: coordinate grid at the maximum length (built on the fly when None).

    Returns:
        [`ExamplePlan`].

    Example (T = 6 tokens, response = the last 3, K = 3, no dropping):

        >>> ids = torch.tensor([1, 5, 6, 7, 8, 2]); resp = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> p = plan_example(ids, resp, torch.ones(10, dtype=torch.bool), 3, 1.0, 1.0)
        >>> p.num_anchors, list(zip(p.anchor.tolist(), p.depth.tolist()))
        (4, [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (0, 2), (1, 2)])
        >>> p.supervised.int().tolist()  # labels x_{a+d+2}: positions 2 3 4 5 | 3 4 5 | 4 5
        [0, 1, 1, 1, 1, 1, 1, 1, 1]
    """
    k = int(num_parallel_positions)
    input_ids = input_ids.cpu()
    length = int(input_ids.numel())
    n = max(length - 2, 0)
    label_ok = loss_mask.cpu().bool() & in_draft_vocab.cpu()[input_ids]
    label_pos = torch.arange(n)[None, :] + torch.arange(k)[:, None] + 2  # (K, n)
    in_range = label_pos < length
    sup_grid = torch.zeros(k, n, dtype=torch.bool)
    sup_grid[in_range] = label_ok[label_pos[in_range]]
    # a chain is worth extending to depth d if some element at depth >= d is supervised
    eligible = sup_grid.flip(0).int().cummax(0).values.flip(0).bool()
    keep = cod_sample(n, k, cod_ratio, cod_min_ratio, generator=generator, eligible=eligible)
    if template is None or template.max_anchors < n or template.num_parallel_positions < k:
        template = PEagleMaskTemplate(n, k)
    anchor, depth = template.coordinates(keep)
    supervised = sup_grid[depth, anchor]
    segments = partition_plan(anchor, depth, n, num_segments, balance=balance)
    return ExamplePlan(length, n, anchor, depth, supervised, segments)


def cod_seed(seed: int, step: int, ids: torch.Tensor) -> int:
    """Per-example COD seed from the run seed, the optimiser step and the example's tokens.

    It does not depend on the process, batch position or partitioning, so a DDP run, a single-process run of the
    same global batch and a resumed run all draw the same elements.
    """
    crc = zlib.crc32(ids.to(torch.int64).numpy().tobytes())
    return (int(seed) * 1_000_003 + int(step) * 7_919 + crc) % (2**63 - 1)


@dataclass
class SegmentRows:
    """Elements of one segment for a batch of rows: `(B, E)` tensors, laid out ``[unsupervised, pad, supervised]``
    per row so the supervised ones are the last `keep` columns (`logits_to_keep`)."""

    anchor: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    supervised: torch.Tensor
    keep: int

    @property
    def width(self) -> int:
        return int(self.anchor.shape[1])

    def to(self, device) -> SegmentRows:
        return SegmentRows(
            self.anchor.to(device),
            self.depth.to(device),
            self.valid.to(device),
            self.supervised.to(device),
            self.keep,
        )


def segment_rows(plans: list[ExamplePlan], s: int, depth: int | None = None) -> SegmentRows:
    """The elements segment `s` owns in every plan (one row per example, `(B, E)`), only depth `depth` if given.

    Unsupervised elements come first, the supervised ones last; rows are padded in between (`valid` False).
    """
    parts = []
    for plan in plans:
        idx = plan.segments[s].elements
        if depth is not None:
            idx = idx[plan.depth[idx] == depth]
        sup = plan.supervised[idx]
        parts.append((idx[~sup], idx[sup], plan))
    u_max = max(p[0].numel() for p in parts)
    s_max = max(p[1].numel() for p in parts)
    bsz, width = len(plans), u_max + s_max
    anchor = torch.zeros(bsz, width, dtype=torch.long)
    dep = torch.zeros(bsz, width, dtype=torch.long)
    valid = torch.zeros(bsz, width, dtype=torch.bool)
    sup = torch.zeros(bsz, width, dtype=torch.bool)
    for b, (u_idx, s_idx, plan) in enumerate(parts):
        for cols, idx, is_sup in (
            (slice(0, u_idx.numel()), u_idx, False),
            (slice(width - s_idx.numel(), width), s_idx, True),
        ):
            anchor[b, cols] = plan.anchor[idx]
            dep[b, cols] = plan.depth[idx]
            valid[b, cols] = True
            sup[b, cols] = is_sup
    return SegmentRows(anchor, dep, valid, sup, s_max)


def prefix_rows(plans: list[ExamplePlan], s: int, device=None) -> SegmentRows:
    """The prefix of segment `s` as key rows: the depth-0 elements of anchors ``0 .. P-1`` (P the longest prefix in
    the batch), valid below each example's own segment start."""
    length = max(p.segments[s].start for p in plans)
    starts = torch.tensor([p.segments[s].start for p in plans], device=device)
    anchor = torch.arange(length, device=device).expand(len(plans), -1)
    valid = anchor < starts[:, None]
    return SegmentRows(anchor, torch.zeros_like(anchor), valid, torch.zeros_like(valid), 0)


def parallel_drafter_inputs(
    input_ids: torch.Tensor,
    features: torch.Tensor,
    anchor: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    mask_token_id: int,
) -> dict[str, torch.Tensor]:
    """Drafter inputs of P-EAGLE training elements.

    Args:
        input_ids: `(B, T)` tokens of the examples.
        features: `(B, T, 3 * H_t)` target features ``f_0 .. f_{T-1}``.
        anchor, depth, valid: `(B, E)` element coordinates; `valid` False at padding.
        mask_token_id: the head's mask token.

    Returns:
        Keyword arguments of `PEagleDrafter.forward`, each `(B, E, ...)`: element ``(a, 0)`` reads token
        ``x_{a+1}`` and features ``f_a`` at position ``a``; element ``(a, d >= 1)`` is a parallel slot
        (`parallel_mask` True) at position ``a + d``.  Padding elements are parallel slots.
    """
    parallel = (depth > 0) | ~valid
    tok = input_ids.gather(1, (anchor + 1).clamp(max=input_ids.shape[1] - 1))
    tok = torch.where(parallel, torch.full_like(tok, mask_token_id), tok)
    feats = features.gather(1, anchor[..., None].expand(-1, -1, features.shape[-1]))
    return {
        "input_ids": tok,
        "target_hidden_states": feats,
        "position_ids": anchor + depth,
        "parallel_mask": parallel,
    }


__all__ = [
    "ExamplePlan",
    "plan_example",
    "cod_seed",
    "SegmentRows",
    "segment_rows",
    "prefix_rows",
    "parallel_drafter_inputs",
]
