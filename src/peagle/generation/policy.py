"""The drafting policies: how many drafts (or tree nodes) a round verifies and when the drafter runs at all.

Each `generate()` call runs one policy, recorded as `draft_policy` in the statistics (docs/DESIGN.md section 7):
[`FixedPolicy`] (threshold 0.0: every round verifies all K drafts), [`ThresholdPolicy`] (the confidence cut of
section 3.3) and [`CostPolicy`] (no threshold: the cost-aware rule, from the head's calibrated probabilities and the
machine's measured costs, which also skips the drafter while drafting does not pay).  [`make_policy`] picks it from
the call's [`DraftingSettings`].  The drafting side ([`drafting.DraftingSession`]) asks its policy at the same
points of every round, whatever the policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..modeling_peagle import PEagleDrafter
from .cost import (
    TimingBudget,
    VerifyCostModel,
    cost_model_for,
    ensure_row_seconds,
    extend_to_context,
    persist_cost_model,
)
from .drafter_cache import DrafterCache
from .rule import (
    AcceptanceCorrection,
    best_batch_rate,
    calibrated_probabilities,
    chain_gains,
    choose_batch_tree_size,
)
from .settings import DraftingSettings
from .stats import PEagleGenerationStats, context_bucket
from .tree import DraftTree

_clock = time.perf_counter
"""The drafting side's clock (the cost rule times the passes it observes with it; tests replace it)."""

PAYS_SMOOTHING = 0.3
"""Weight of the newest drafting round in the running estimate of whether drafting pays (cost rule)."""
PAYS_MARGIN = 0.05
"""Cost rule: drafting continues only while its estimated rate beats a plain step's by this fraction; a smaller
gain is within the cost model's error (its predicted seconds come within a few percent of the measured ones),
and where verifying costs nearly what it returns (a batch of 8 on a CPU) drafting would lose as often as win."""
MAX_SKIP = 32
"""Most plain steps in a row without running the drafter (cost rule); each losing probe doubles the skip."""
CATCH_UP_SLOTS = 256
"""A drafter round over at least this many new slots is a catch-up (the prompt, or a long skip's slots)."""
PROBE_FIRST, PROBE_EVERY, PROBE_MIN = 4, 64, 3
"""Cost rule: a plain step is taken after `PROBE_FIRST` target passes without one while the curve has fewer
than `PROBE_MIN` observed plain steps, and after `PROBE_EVERY` passes later on, so the plain step's cost (what
every drafting round is compared with) is measured, not only modelled."""


def calibrated_rows(calibration: dict[str, Any] | None, confidences: list[list[float]]) -> list[list[float]]:
    """Per row, the head's calibrated acceptance probabilities of its drafts, before this generation's
    correction (what the correction learns from).  `confidences[depth][row]`."""
    return [calibrated_probabilities(calibration, list(c)) for c in zip(*confidences, strict=True)]


class DraftPolicy:
    """What every policy answers during a round; this base verifies everything the round drafted.

    Args:
        settings: the call's settings.
        stats: the call's statistics (the policy counts its own decisions there).
    """

    cost: VerifyCostModel | None = None
    prediction: RoundPrediction | None = None
    """The round under verification as the cost rule predicted it, or None."""

    def __init__(self, settings: DraftingSettings, stats: PEagleGenerationStats):
        self.settings, self.stats = settings, stats
        self.idle: set[int] = set()  # rows of the batch that ended and stay only to keep passes fast

    def begin(self, histories: list[torch.LongTensor], now: float, last_num_drafts: int) -> float:
        """A round starts at `now` after a target pass that verified `last_num_drafts`; returns when the round's
        own drafting time starts (later when costs were timed first)."""
        return now

    def skips(self, max_drafts: int) -> bool:
        """Whether this round is a plain step without running the drafter."""
        return False

    def stop(self, confidences: list[list[float]]) -> bool:
        """Whether the round ends after the drafts just picked (`confidences[depth][row]`)."""
        return False

    def keep_expanding(self) -> Callable[[list[list[float]]], bool] | None:
        """For an autoregressive head's tree: whether one more level pays (None: expand every level)."""
        return None

    def drafter_ran(self, seconds: float, slots: int) -> None:
        """The drafter ran for `seconds` over `slots` new real slots."""

    def chain_size(self, confidences: list[list[float]], drafter_seconds: float, steps: int) -> int:
        """How many of the round's drafts (`len(confidences)`) every row verifies."""
        return len(confidences)

    def tree_size(
        self, trees: list[DraftTree], confidences: list[list[float]], drafter_seconds: float, steps: int
    ) -> int:
        """How many nodes every row's tree verifies: the full budget."""
        return self._count_tree(self.settings.tree_nodes)

    def _count_tree(self, n: int) -> int:
        self.stats.tree_size_histogram[n] += 1
        return n

    def prefill_next(self) -> None:
        """The prefill runs next (a plain step that is no verify pass to learn from)."""

    def returned(self) -> None:
        """Candidates go to verification now."""

    def plain_step(self) -> None:
        """This round is a plain step."""

    def verified(self, accepted: list[int], counted: list[int]) -> None:
        """The round just verified: `accepted[b]` drafts kept by each counted row `b`."""

    def rows_to_keep(self, live: int, most: int) -> int:
        """How many rows the batch keeps when `live` rows still decode and up to `most` could stay."""
        return live

    def finish(self) -> None:
        """The call ended."""


class FixedPolicy(DraftPolicy):
    """Threshold 0.0: every round verifies all K drafts (or the full tree), as vLLM does."""


class ThresholdPolicy(DraftPolicy):
    """The confidence cut: a row's round keeps its drafts up to and including the first one whose probability
    under the head is below the threshold (transformers' rule per row); a tree keeps the nodes whose path
    probability reaches it in some row."""

    def stop(self, confidences: list[list[float]]) -> bool:
        t = self.settings.confidence_threshold
        return all(any(c < t for c in column) for column in zip(*confidences, strict=True))

    def tree_size(
        self, trees: list[DraftTree], confidences: list[list[float]], drafter_seconds: float, steps: int
    ) -> int:
        t = self.settings.confidence_threshold
        return self._count_tree(max(sum(v >= t for v in tree.values) for tree in trees))


@dataclass(frozen=True)
class RoundPrediction:
    """A round under verification as the cost rule chose it.

    Args:
        calibrated: per row, the calibrated probabilities of the chain drafts it verifies (what the correction
            learns from).
        row_tokens: per row, the tokens the round is expected to emit.
        seconds: the modelled verify seconds plus the drafter's measured ones.
        drafter_seconds: the drafter's measured seconds.
        rate_seconds: the round's modelled seconds (verify plus drafter), for whether drafting pays.
        plain_seconds: a plain step's modelled seconds.
    """

    calibrated: list[list[float]]
    row_tokens: list[float]
    seconds: float
    drafter_seconds: float
    rate_seconds: float
    plain_seconds: float


class CostPolicy(DraftPolicy):
    """The cost-aware rule (docs/DESIGN.md section 7): per round, the number of drafts or nodes with the best
    expected tokens per second by the machine's measured costs, plain steps that measure a plain step's cost, and
    the drafter skipped while drafting does not pay.

    Args:
        settings, stats: as for [`DraftPolicy`].
        target, head: the call's models (their costs are timed on first use).
        drafter_cache: the drafter's cache (its length is the drafter's context).
        correction: this generation's correction of the calibration.
    """

    def __init__(
        self,
        settings: DraftingSettings,
        stats: PEagleGenerationStats,
        target: Any,
        head: PEagleDrafter,
        drafter_cache: DrafterCache,
        correction: AcceptanceCorrection,
    ):
        super().__init__(settings, stats)
        self.target, self.head, self.drafter_cache, self.correction = target, head, drafter_cache, correction
        tokens = max(settings.num_speculative_tokens, settings.tree_nodes) + 1
        self.budget = TimingBudget()  # all the timing this call may do (none was asked for)
        self.cost = cost_model_for(target, head, tokens, batch_size=settings.batch_size, budget=self.budget)
        stats.cost_timing_seconds = self.budget.spent
        self._hopeless: tuple[int, bool] | None = None  # (context bucket, whether drafting cannot pay there)
        self._skip_left = 0  # plain steps to take before the drafter runs again
        self._skip_len = 1  # the next skip's length (doubles while drafting keeps losing)
        self._returned_at: float | None = None  # when the last candidates went to verification
        self._pays: float | None = None  # running ratio of drafting's realised rate to a plain step's
        self._context = 0  # the target's context (tokens per row, padding included) at this round
        self._verify_context = 0  # ... at the pass under verification
        self._since_plain = 0  # target passes since the last plain step (probes)

    # ------------------------------------------------------------------ timing the passes
    def begin(self, histories: list[torch.LongTensor], now: float, last_num_drafts: int) -> float:
        """Fold the timing of the target pass that just ran into the cost model; time a longer context's costs
        first when the call's context needs them (once per machine and context)."""
        self._observe_verify(now, last_num_drafts)
        self._context = max(h.shape[1] for h in histories)
        spent = extend_to_context(
            self.cost,
            self.target,
            self.head,
            self._context,
            len(self.cost.verify_seconds),
            self.settings.batch_size,
            self.budget,
        )
        if spent:
            self.stats.cost_timing_seconds = self.budget.spent
            self._hopeless = None  # the context's costs are known better now
            return _clock()
        return now

    def _observe_verify(self, now: float, last_num_drafts: int) -> None:
        """The target pass that just ran (a verify pass or a plain step) into the cost model, and the round's
        predicted and measured seconds into the stats (per context bucket)."""
        if self._returned_at is None:
            return
        seconds = now - self._returned_at
        n, context, r = last_num_drafts + 1, self._verify_context, self.prediction
        predicted = self.cost.cost(n, context) if r is None else r.rate_seconds
        measured = seconds if r is None else seconds + r.drafter_seconds
        self.cost.observe_verify(n, seconds, context)
        if r is not None:
            self.stats.predicted_seconds += r.seconds
            self.stats.measured_seconds += measured
            self.prediction = None
        self.stats.observe_pass(context, self.settings.batch_size, predicted, measured)

    def returned(self) -> None:
        self._since_plain += 1
        self._verify_context = self._context
        self._returned_at = _clock()

    def plain_step(self) -> None:
        self._since_plain = 0
        self.prediction = None
        self._verify_context = self._context
        self._returned_at = _clock()

    def prefill_next(self) -> None:
        """The prefill runs next: not a verify pass to learn from."""
        self._returned_at = None

    def drafter_ran(self, seconds: float, slots: int) -> None:
        if slots >= CATCH_UP_SLOTS:
            self.cost.observe_catch_up(seconds, slots)

    # ------------------------------------------------------------------ whether the drafter runs
    def skips(self, max_drafts: int) -> bool:
        """A plain step while drafting cannot pay at this context even at best ([`cannot_pay`]), while a skip
        lasts, to probe a plain step's cost, or for the whole call when drafting did not pay at this context
        before and the catch-up over the prompt would not pay either."""
        if self.cannot_pay():
            self.stats.skipped_drafter_rounds += 1
            return True
        if self._skip_left > 0:
            self._skip_left -= 1
            self.stats.skipped_drafter_rounds += 1
            return True
        if self._probe_due():
            self.stats.probe_steps += 1
            return True
        if self._pays is None and self._start_from_memory(max_drafts):
            self.stats.skipped_drafter_rounds += 1
            return True
        return False

    def cannot_pay(self) -> bool:
        """Whether even the head's best case cannot pay at this context: a round verifying n drafts (or nodes), all
        accepted, emits n + 1 tokens per row for the verify pass over n + 1 plus the drafter's round (an
        autoregressive head's: one more pass per draft), and for no n does that beat a plain step's token by
        `PAYS_MARGIN`.  Then the call takes plain steps without the drafter and without probes until the context
        reaches another bucket (decided once per bucket, from the curve at hand)."""
        bucket = context_bucket(self._context)
        if self._hopeless is None or self._hopeless[0] != bucket:
            s, cost = self.settings, self.cost
            most = max(s.num_speculative_tokens, s.tree_nodes)
            curve = cost.curve(most + 1, self._context)
            drafter = cost.drafter_cost(self.drafter_cache.length)
            step = cost.drafter_step_seconds if s.drafting_mode == "autoregressive" else 0.0
            best = max(
                (n + 1) / (curve[n] + drafter + step * (min(n, s.num_speculative_tokens) - 1))
                for n in range(1, most + 1)
            )
            self._hopeless = (bucket, best * curve[0] < 1.0 + PAYS_MARGIN)
        return self._hopeless[1]

    def _start_from_memory(self, remaining: int) -> bool:
        """Before a call's first drafting round: where drafting did not pay at this context in an earlier call,
        skip the drafter for the whole call unless its catch-up over the prompt costs less than `PAYS_MARGIN` of
        the plain steps left (drafting that did not pay is not expected to win more back; a long answer can still
        afford to look again); when it runs, the running estimate starts from that call's.  Returns whether this
        step skips the drafter."""
        remembered = self.cost.remembered_pays(self._context)
        if remembered is None or remembered >= 1.0 + PAYS_MARGIN:
            return False
        catch_up = self.drafter_cache.pending_slots() * self.cost.drafter_slot_seconds
        if catch_up > PAYS_MARGIN * remaining * self.cost.cost(1, self._context):
            self._skip_left = remaining + 1  # the rest of the call
            return True
        self._pays = remembered  # this round drafts: it is the new prompt's first evidence
        return False

    def _probe_due(self) -> bool:
        """Whether this pass should be a plain step to measure one (measured curves only)."""
        if not self.cost.refined_online:
            return False
        few = self.cost.observations[0] < PROBE_MIN
        return self._since_plain >= (PROBE_FIRST if few else PROBE_EVERY)

    def _fold_pays(self, ratio: float) -> None:
        """One round's drafting rate against a plain step's into the running estimate; while it is below
        1 + `PAYS_MARGIN` the next rounds skip the drafter (1 plain step, then 2, 4, ... up to `MAX_SKIP` while
        the probes keep losing)."""
        self._pays = (
            ratio if self._pays is None else (1 - PAYS_SMOOTHING) * self._pays + PAYS_SMOOTHING * ratio
        )
        if self._pays < 1.0 + PAYS_MARGIN:
            self._skip_left, self._skip_len = self._skip_len, min(self._skip_len * 2, MAX_SKIP)
        else:
            self._skip_len = 1

    # ------------------------------------------------------------------ how much a round verifies
    def _row_probabilities(self, confidences: list[list[float]]) -> list[list[float]]:
        """Per row, the acceptance probabilities of its drafts: the head's calibration, corrected by the rounds
        this generation verified so far."""
        return [self.correction.apply(row) for row in calibrated_rows(self.settings.calibration, confidences)]

    def stop(self, confidences: list[list[float]]) -> bool:
        """Autoregressive heads: the unroll stops once one more drafter pass no longer pays."""
        if self.settings.drafting_mode != "autoregressive":
            return False
        return not self._one_more_pass_pays(confidences)

    def keep_expanding(self) -> Callable[[list[list[float]]], bool]:
        return self._one_more_pass_pays

    def _one_more_pass_pays(self, confidences: list[list[float]]) -> bool:
        """Whether drafting one more token can raise the expected rate, assuming each row's next draft is as
        likely to be accepted as its last one."""
        rows = self._row_probabilities(confidences)
        depth = len(confidences)
        curve = self.cost.curve(depth + 2, self._context)
        spent = self.cost.drafter_cost(self.drafter_cache.length) + self.cost.drafter_step_seconds * (
            depth - 1
        )
        # one more pass only raises the best rate if the rule would verify the extra draft as well
        more = best_batch_rate([r + r[-1:] for r in rows], curve, spent + self.cost.drafter_step_seconds)
        return more > best_batch_rate(rows, curve, spent)

    def chain_size(self, confidences: list[list[float]], drafter_seconds: float, steps: int) -> int:
        calibrated = calibrated_rows(self.settings.calibration, confidences)
        keep = self._choose(
            [chain_gains(self.correction.apply(row)) for row in calibrated],
            calibrated,
            drafter_seconds,
            steps,
            self.stats.chosen_k_histogram,
        )
        if keep == 0:
            self.stats.declined_rounds += 1
        return keep

    def tree_size(
        self, trees: list[DraftTree], confidences: list[list[float]], drafter_seconds: float, steps: int
    ) -> int:
        n = self._choose(
            [t.gains() for t in trees],
            calibrated_rows(self.settings.calibration, confidences),
            drafter_seconds,
            steps,
            self.stats.tree_size_histogram,
            chain_nodes=lambda n: [sum(t.chain[:n]) for t in trees],
        )
        if n == 0:
            self.stats.declined_rounds += 1
        return n

    def _choose(
        self,
        gains: list[list[float]],
        chains: list[list[float]],
        drafter_seconds: float,
        steps: int,
        histogram: list[int],
        chain_nodes: Callable[[int], list[int]] | None = None,
    ) -> int:
        """How many drafts (chain) or nodes (tree) every row verifies, and whether the next rounds skip the
        drafter.  `gains[row]`: the expected tokens each further draft adds ([`rule.choose_batch_tree_size`]);
        `chains[row]`: the uncorrected calibrated probabilities along the head's chain, of which `chain_nodes(n)`
        (default: n) are verified at size n."""
        drafter_context = self.drafter_cache.length
        self.cost.observe_drafter(drafter_seconds, steps, drafter_context)
        width = min(len(g) for g in gains)
        curve = self.cost.curve(width + 1, self._context)  # the costs at this round's context and batch size
        drafter = self.cost.drafter_cost(drafter_context)
        live = [b for b in range(len(gains)) if b not in self.idle]  # idle rows' tokens count for nothing
        n = choose_batch_tree_size([gains[b] for b in live], curve, drafter)
        histogram[n] += 1
        if n == 0:  # declined: the drafter's time spent for nothing, against a plain step's
            self.prediction = None
            self._fold_pays(curve[0] / (curve[0] + drafter_seconds))
            return n
        verified = chain_nodes(n) if chain_nodes is not None else [n] * len(chains)
        self.prediction = RoundPrediction(
            calibrated=[c[:m] for c, m in zip(chains, verified)],
            row_tokens=[1.0 + sum(g[:n]) for g in gains],
            seconds=curve[n] + drafter_seconds,
            drafter_seconds=drafter_seconds,
            rate_seconds=curve[n] + drafter,
            plain_seconds=curve[0],
        )
        return n

    # ------------------------------------------------------------------ after the verify pass
    def verified(self, accepted: list[int], counted: list[int]) -> None:
        """Does drafting pay?  The tokens this round realised per row, at its modelled seconds, against a plain
        step's one token (the calibration's promise does not count here, the outcome does)."""
        r, rows = self.prediction, len(counted)
        if r is None or not rows:
            return
        kept = sum(accepted[b] for b in counted)
        self.stats.predicted_tokens += sum(r.row_tokens[b] for b in counted)
        self.stats.realised_tokens += kept + rows
        self._fold_pays((kept + rows) / rows / r.rate_seconds * r.plain_seconds)

    def rows_to_keep(self, live: int, most: int) -> int:
        """The count whose plain step the cost model measures cheapest (ties: fewer), timed once per machine and
        count; `live` without measured curves."""
        if not self.cost.refined_online or most <= live:
            return live
        spent, seconds = 0.0, {}
        try:
            for count in range(live, most + 1):
                value, took = ensure_row_seconds(self.cost, self.target, count, self.budget)
                spent += took
                if value is None:  # not timeable, or not within this call's timing budget
                    return live
                seconds[count] = value
        finally:
            self.stats.cost_timing_seconds = self.budget.spent
            if self._returned_at is not None:  # the timing is not part of the pass being timed
                self._returned_at += spent
        return min(seconds, key=lambda c: (seconds[c], c))

    def finish(self) -> None:
        """The cost curve's online figures go to its cache file, and whether drafting paid at this context is
        remembered for the next call."""
        if self._pays is not None:
            self.cost.remember_pays(self._context, self._pays)
        persist_cost_model(self.cost)


def make_policy(
    settings: DraftingSettings,
    stats: PEagleGenerationStats,
    target: Any,
    head: PEagleDrafter,
    drafter_cache: DrafterCache,
    correction: AcceptanceCorrection,
) -> DraftPolicy:
    """The call's policy, by `settings.policy`."""
    if settings.policy == "cost":
        return CostPolicy(settings, stats, target, head, drafter_cache, correction)
    if settings.policy == "threshold":
        return ThresholdPolicy(settings, stats)
    return FixedPolicy(settings, stats)


__all__ = [
    "CostPolicy",
    "DraftPolicy",
    "FixedPolicy",
    "RoundPrediction",
    "ThresholdPolicy",
    "make_policy",
]
