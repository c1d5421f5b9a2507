"""`PartitionedStep`: the forward (and backward) passes of one micro-batch over its partition segments.

A micro-batch's elements are split into segments ([`peagle.training.partition`]); segment s reads the depth-0
elements of earlier segments as keys and values only, its prefix ([`PrefixKV`], docs/DESIGN.md section 4.6).  A
[`PartitionedStep`] owns that prefix store and the order of the segments, and runs one segment at a time
([`PartitionedStep.run`]), returning a [`SegmentPass`]:

- evaluation (``backward=False``): the segments run in order; each pass stores its depth-0 keys and values for
  the segments after it;
- training (``backward=True``): [`PartitionedStep.store_prefix`] first stores every prefix without gradients,
  then the segments run in reverse order.  Each pass reads its prefix as gradient leaves; the caller
  backpropagates ``loss * scale + surrogate`` (the surrogate carries the gradient later segments sent to this
  segment's keys and values), then [`PartitionedStep.collect`] adds the gradient of the leaves to the store for
  the segments before it.

Autoregressive (EAGLE-3) heads run each segment as a training-time-test unroll (section 4.7).  An
[`AcceptanceRecorder`] given to the step also records, per supervised element, whether greedy verification
accepts the drafter's top token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from ..configuration_peagle import PEagleConfig
from .losses import TargetDistribution
from .masks import peagle_attention_mask, peagle_block_mask
from .plan import ExamplePlan, SegmentRows, parallel_drafter_inputs, prefix_rows, segment_rows
from .prefix import PrefixKV


@dataclass(frozen=True)
class StepSettings:
    """What a [`PartitionedStep`] reads from its trainer.

    Attributes:
        config: the head's config (mask token, attention implementation, the cache's layers).
        num_parallel_positions: K_train, the deepest element's depth + 1.
        draft_lm_weight: `(V_draft, H_t)`, the rows of the target's `lm_head` for the draft vocabulary.
        softcap: the target's final-logit soft-cap, or None.
        loss_type: `"kl"` or `"ce"` ([`TargetDistribution`]).
        ttt_decay: the weight base of an autoregressive head's unroll: step d weighs ``ttt_decay ** d``.
        flex_block_size: the tile of a flex-attention block mask (heads built with `flex_attention`).
        global_step: the optimiser step, named in errors.
        no_sync: enters a context in which a backward pass leaves DDP's gradients unsynchronised (the
            autoregressive unroll runs all its steps but the last in it).
    """

    config: PEagleConfig
    num_parallel_positions: int
    draft_lm_weight: torch.Tensor
    softcap: float | None
    loss_type: str
    ttt_decay: float
    flex_block_size: int
    global_step: int
    no_sync: Callable[[], AbstractContextManager]


@dataclass
class SegmentPass:
    """One segment's forward pass.

    Attributes:
        loss: the summed loss of the supervised elements the segment owns (in the autograd graph when
            training); a zero that still depends on the head's output when it owns none.
        correct: `(K_train,)` per depth, the supervised elements whose top draft is the target's top token;
            None for a segment without supervised elements.
        total: `(K_train,)` per depth, the supervised elements; None with `correct`.
        surrogate: training only: a scalar whose gradient is the one later segments sent to this segment's
            depth-0 keys and values; add it to the loss before backward (None when there is none).
        prefix_leaves: training only: the prefix keys and values this pass read, as gradient leaves, in the
            order [`PrefixKV.collect`] takes.
    """

    loss: torch.Tensor
    correct: torch.Tensor | None = None
    total: torch.Tensor | None = None
    surrogate: torch.Tensor | None = None
    prefix_leaves: list[torch.Tensor] = field(default_factory=list)


class AcceptanceRecorder:
    """Collects, for every supervised element a [`PartitionedStep`] scores, `(row, anchor, depth, accepted)`:
    accepted when the drafter's top token is the target's argmax over its whole vocabulary (what greedy
    verification accepts).

    Args:
        lm_weight: `(V, H_t)`, the target's whole `lm_head` weight.
        draft_to_target: `(V_draft,)`, the target id of each draft-vocabulary index.
    """

    def __init__(self, lm_weight: torch.Tensor, draft_to_target: torch.Tensor):
        self.lm_weight = lm_weight
        self.draft_to_target = draft_to_target
        self._rows: list[torch.Tensor] = []

    def mark(self, target: TargetDistribution, last_hidden: torch.Tensor, softcap: float | None) -> None:
        """Mark where `target`'s draft-vocabulary argmax is also its argmax over the whole vocabulary."""
        target.mark_global_argmax(last_hidden, self.lm_weight, self.draft_to_target, softcap)

    def add(
        self,
        target: TargetDistribution,
        batch_idx: torch.Tensor,
        anchor: torch.Tensor,
        depth: torch.Tensor,
        correct: torch.Tensor,
    ) -> None:
        """Record the scored elements `(batch_idx, anchor, depth)` and whether each draft is accepted."""
        pos = anchor + depth + 1
        accepted = correct & target.at(target.argmax_is_global, batch_idx, pos)
        self._rows.append(torch.stack([batch_idx, anchor, depth, accepted.long()], 1).cpu())

    def records(self) -> torch.Tensor:
        """`(N, 4)` long: one `(row, anchor, depth, accepted)` per recorded element."""
        return torch.cat(self._rows) if self._rows else torch.zeros(0, 4, dtype=torch.long)


@dataclass
class _PrefixView:
    """What a segment's pass reads of the prefix: the cache holding it, its key rows, its length and (training)
    the cache's gradient leaves."""

    cache: DynamicCache | None
    key_rows: list[SegmentRows]
    past: int
    leaves: list[torch.Tensor]


class PartitionedStep:
    """The segment passes of one micro-batch: the prefix store, the segments' order, and each pass.

    Segments run up to the last one with a supervised element; a segment that owns no element is skipped.  When
    no segment has a supervised element (nothing to learn on this process), the step is one zero-weight pass
    over the largest segment, which keeps DDP's reducer fed.

    Args:
        model: the head to call (wrapped by DDP when training on several processes).
        inputs: the micro-batch (`input_ids`, ...).
        plans: the [`ExamplePlan`] of each row, all with the same number of segments.
        features: the target's `(aux, last)` features of the micro-batch ([`capture_features`]).
        settings: [`StepSettings`].
        backward: whether the caller backpropagates each pass (the segments then run in reverse order).
        acceptance: an [`AcceptanceRecorder`] to fill, or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        plans: list[ExamplePlan],
        features: tuple[torch.Tensor, torch.Tensor],
        settings: StepSettings,
        backward: bool = False,
        acceptance: AcceptanceRecorder | None = None,
    ):
        self.model = model
        self.input_ids = inputs["input_ids"]
        self.plans = plans
        self.aux, self.last = features
        self.settings = settings
        self.backward = backward
        self.acceptance = acceptance
        num_segments = len(plans[0].segments)
        self.rows = [segment_rows(plans, s) for s in range(num_segments)]
        supervised = [s for s in range(num_segments) if self.rows[s].keep > 0]
        self.prefix: PrefixKV | None = None
        if not supervised:
            s = max(range(num_segments), key=lambda j: self.rows[j].width)
            if self.rows[s].width == 0:
                raise ValueError(
                    f"a batch has no training elements: examples need >= 3 tokens, got {[p.length for p in plans]}."
                )
            self._segments = [s]
            return
        end = max(supervised) + 1
        if end > 1:
            self.prefix = PrefixKV(settings.config, max(p.num_anchors for p in plans))
        self._segments = [s for s in range(end) if self.rows[s].width > 0]

    @property
    def order(self) -> list[int]:
        """The segments, in the order [`run`] takes them: reverse order when training with a prefix."""
        if self.backward and self.prefix is not None:
            return self._segments[::-1]
        return list(self._segments)

    def store_prefix(self) -> None:
        """Training: forward the depth-0 elements of every segment but the last, in order and without gradients,
        and store their keys and values.  Call it once, before the first [`run`]."""
        if not self.backward or self.prefix is None:
            return
        with torch.no_grad():
            for s in self._segments[:-1]:
                self._prefix_pass(s)

    def run(self, s: int) -> SegmentPass:
        """Forward segment `s` (one of [`order`]) and score its supervised elements."""
        if self.settings.config.drafting_mode == "autoregressive":
            return self._autoregressive(s)
        return self._parallel(s)

    def collect(self, result: SegmentPass, scaler: torch.amp.GradScaler | None = None) -> None:
        """After the backward pass of `result`: add the gradient its prefix leaves received to the store, for the
        segments before it (divided by the loss scale of `scaler`, a `GradScaler`, when given)."""
        if self.prefix is None or not result.prefix_leaves:
            return
        self.prefix.collect(result.prefix_leaves, float(scaler.get_scale()) if scaler is not None else 1.0)

    # ----------------------------------------------------------------------------------------- the prefix
    def _prefix_view(self, s: int, leaves: bool) -> _PrefixView:
        if self.prefix is None:
            return _PrefixView(None, [], 0, [])
        past = max(p.segments[s].start for p in self.plans)
        cache, held = self.prefix.cache(past, leaves=leaves)
        return _PrefixView(cache, [prefix_rows(self.plans, s, self.input_ids.device)], past, held)

    def _prefix_pass(self, s: int) -> None:
        """Forward the depth-0 elements of segment `s` after its prefix and store their keys and values."""
        rows = segment_rows(self.plans, s, depth=0).to(self.input_ids.device)
        if rows.width == 0:
            return
        view = self._prefix_view(s, leaves=False)
        self.model(
            **parallel_drafter_inputs(
                self.input_ids,
                self.aux,
                rows.anchor,
                rows.depth,
                rows.valid,
                self.settings.config.mask_token_id,
            ),
            attention_mask=self._attention(rows, view.key_rows + [rows]),
            cache=view.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.prefix.record(view.cache, view.past, rows)

    def _after_forward(
        self, view: _PrefixView, cache: DynamicCache | None, rows: SegmentRows
    ) -> torch.Tensor | None:
        """Store a pass's depth-0 keys and values (in order), or return the surrogate that sends them the gradient
        of later segments (training, in reverse order)."""
        if self.prefix is None:
            return None
        if self.backward:
            return self.prefix.surrogate(cache, view.past, rows)
        self.prefix.record(cache, view.past, rows)
        return None

    def _attention(self, rows: SegmentRows, key_rows: list[SegmentRows] | None = None):
        """Mask of the queries `rows` over the keys (`key_rows` concatenated, the queries last; default the
        queries themselves): a flex-attention `BlockMask` for flex heads, else a dense `(B, 1, Eq, Ek)` bool."""
        keys = {}
        if key_rows is not None:
            keys = {
                "key_anchor": torch.cat([r.anchor for r in key_rows], 1),
                "key_depth": torch.cat([r.depth for r in key_rows], 1),
                "key_valid": torch.cat([r.valid for r in key_rows], 1),
            }
        if self.settings.config._attn_implementation == "flex_attention":
            return peagle_block_mask(
                rows.anchor,
                rows.depth,
                rows.valid,
                pad_self=True,
                block_size=self.settings.flex_block_size,
                **keys,
            )
        return peagle_attention_mask(rows.anchor, rows.depth, rows.valid, pad_self=True, **keys)[:, None]

    # ----------------------------------------------------------------------------------------- the loss
    def _target_distribution(self, s: int) -> TargetDistribution:
        """The target's distribution over the draft vocabulary at the positions segment `s` learns from (the window
        from its first anchor + 1 to its last anchor + K_train), once per segment: the elements that predict the
        same position share it, and a long example never holds its whole `(T, V_draft)` table at once.  With an
        [`AcceptanceRecorder`], it also marks where the target's argmax over its whole vocabulary lies in the
        draft vocabulary: greedy verification accepts a draft only there."""
        settings = self.settings
        lo = min(p.segments[s].start for p in self.plans) + 1
        hi = min(
            self.last.shape[1], max(p.segments[s].end for p in self.plans) + settings.num_parallel_positions
        )
        lo = min(lo, hi)
        last_hidden = self.last[:, lo:hi]
        target = TargetDistribution.from_hidden(
            last_hidden, settings.draft_lm_weight, settings.softcap, settings.loss_type
        )
        if not target.finite:
            raise FloatingPointError(
                f"the target's logits are not finite at global step {settings.global_step}: the head would "
                f"learn from NaN/inf ({settings.loss_type} loss); check the target's dtype and weights."
            )
        if self.acceptance is not None:
            self.acceptance.mark(target, last_hidden, settings.softcap)
        target.offset = lo
        return target

    def _score(
        self,
        logits: torch.Tensor,
        rows: SegmentRows,
        target: TargetDistribution,
        weights_by_depth: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss sum and per-depth correct and total counts of the supervised columns of `rows`."""
        sub = rows.supervised[:, rows.width - rows.keep :]
        draft = logits[sub]
        depth = rows.depth[:, rows.width - rows.keep :][sub]
        anchor = rows.anchor[:, rows.width - rows.keep :][sub]
        batch_idx = sub.nonzero()[:, 0]
        pos = anchor + depth + 1  # the target's logits at p - 1 predict the label x_p, p = a + d + 2
        weights = None if weights_by_depth is None else weights_by_depth[depth]
        loss, correct = target.loss(draft, batch_idx, pos, weights)
        if self.acceptance is not None:
            self.acceptance.add(target, batch_idx, anchor, depth, correct)
        k = self.settings.num_parallel_positions
        counts_correct = torch.bincount(depth[correct], minlength=k)[:k].detach().cpu()
        counts_total = torch.bincount(depth, minlength=k)[:k].detach().cpu()
        return loss, counts_correct, counts_total

    # ----------------------------------------------------------------------------------------- the passes
    def _parallel(self, s: int) -> SegmentPass:
        """A P-EAGLE segment: every element it owns in one forward pass after its prefix."""
        rows = self.rows[s].to(self.input_ids.device)
        view = self._prefix_view(s, leaves=self.backward)
        out = self.model(
            **parallel_drafter_inputs(
                self.input_ids,
                self.aux,
                rows.anchor,
                rows.depth,
                rows.valid,
                self.settings.config.mask_token_id,
            ),
            attention_mask=self._attention(rows, view.key_rows + [rows] if view.key_rows else None),
            cache=view.cache,
            use_cache=view.cache is not None,
            logits_to_keep=max(rows.keep, 1),
        )
        surrogate = self._after_forward(view, view.cache, rows)
        if rows.keep == 0:  # keeps DDP's reducer fed when a process has nothing to learn from
            return SegmentPass(out.logits.sum() * 0.0, surrogate=surrogate, prefix_leaves=view.leaves)
        loss, correct, total = self._score(out.logits, rows, self._target_distribution(s))
        return SegmentPass(loss, correct, total, surrogate, view.leaves)

    def _autoregressive(self, s: int) -> SegmentPass:
        """EAGLE-3 training-time test over one segment: step d forwards the depth-d elements with a KV cache
        holding the prefix and steps 0..d-1 (kept in the autograd graph)."""
        settings, device = self.settings, self.input_ids.device
        k = settings.num_parallel_positions
        steps = [segment_rows(self.plans, s, depth=d) for d in range(k)]
        steps = [r.to(device) for r in steps if r.width > 0]
        decay = settings.ttt_decay ** torch.arange(k, device=device, dtype=torch.float32)
        view = self._prefix_view(s, leaves=self.backward)
        cache = view.cache if view.cache is not None else DynamicCache(config=settings.config)
        target = self._target_distribution(s) if self.rows[s].keep > 0 else None
        loss = surrogate = previous = None
        correct, total = torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long)
        for i, rows in enumerate(steps):
            sync = contextlib.nullcontext() if i == len(steps) - 1 else settings.no_sync()
            with sync:
                out = self.model(
                    input_ids=self.input_ids.gather(
                        1, (rows.anchor + rows.depth + 1).clamp(max=self.input_ids.shape[1] - 1)
                    ),
                    position_ids=rows.anchor + rows.depth,
                    attention_mask=self._attention(rows, view.key_rows + steps[: i + 1]),
                    parallel_mask=torch.zeros_like(rows.valid),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=max(rows.keep, 1),
                    **self._unroll_hidden(rows, previous),
                )
            if i == 0:
                surrogate = self._after_forward(view, cache, rows)
            previous = (out.last_hidden_state, self._anchor_columns(rows))
            if rows.keep > 0:
                step_loss, step_correct, step_total = self._score(out.logits, rows, target, decay)
                correct += step_correct
                total += step_total
            else:
                step_loss = out.logits.sum() * 0.0
            loss = step_loss if loss is None else loss + step_loss
        return SegmentPass(loss, correct, total, surrogate, view.leaves)

    def _unroll_hidden(
        self, rows: SegmentRows, previous: tuple[torch.Tensor, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """The hidden input of an unroll step: the target's features at the anchors for step 0, else the drafter's
        output hidden state of the same anchor's element one step before (`previous`: that step's hidden states
        and the column of each anchor in it)."""
        if previous is None:
            aux = self.aux
            return {
                "target_hidden_states": aux.gather(1, rows.anchor[..., None].expand(-1, -1, aux.shape[-1]))
            }
        hidden, columns = previous
        src = columns.gather(1, rows.anchor).clamp(min=0)
        return {"projected_hidden_states": hidden.gather(1, src[..., None].expand(-1, -1, hidden.shape[-1]))}

    def _anchor_columns(self, rows: SegmentRows) -> torch.Tensor:
        """`(B, T + 1)`: the column of each anchor's element in `rows` (-1 where it has none)."""
        ids = self.input_ids
        columns = torch.full((ids.shape[0], ids.shape[1] + 1), -1, dtype=torch.long, device=ids.device)
        cols = torch.arange(rows.width, device=ids.device).expand_as(rows.anchor)
        columns.scatter_(1, torch.where(rows.valid, rows.anchor, ids.shape[1]), cols)
        return columns


__all__ = ["PartitionedStep", "SegmentPass", "StepSettings", "AcceptanceRecorder"]
