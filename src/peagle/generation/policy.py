"""The drafting policies: how many drafts (or tree nodes) a round verifies and when the drafter runs at all.

Each `generate()` call runs one policy, recorded as `draft_policy` in the statistics (docs/DESIGN.md section 7):
[`FixedPolicy`] (threshold 0.0: every round verifies all K drafts), [`ThresholdPolicy`] (the confidence cut of
section 3.3) and [`CostPolicy`] (no threshold: the cost-aware rule, from the head's calibrated probabilities and the
machine's measured costs, which also skips the drafter while drafting does not pay).  [`make_policy`] picks it from
the call's [`DraftingSettings`].

The contract is two calls per round.  Before it, [`DraftPolicy.plan`] gets the round's [`RoundState`] and returns a
[`RoundPlan`]: a plain step without the drafter (`skip`), or how the round's drafts are cut and how many drafts or
nodes every row verifies (the plan's `choose`, from the drafts' probabilities; the plan holds the costs it decides
by, so deciding reads no clock and times nothing).  After the verify pass, [`DraftPolicy.observe`] gets the
[`RoundOutcome`]: what was verified and accepted per row and the seconds the decoder measured for its own target and
drafter passes.  Any timing of the machine's costs happens inside `plan`, outside every timed pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..modeling_peagle import PEagleDrafter
from .cost import (
    TimingBudget,
    VerifyCostModel,
    cost_model_for,
    extend_to_context,
    persist_cost_model,
)
from .rule import (
    AcceptanceCorrection,
    best_batch_rate,
    calibrated_probabilities,
    chain_gains,
    choose_batch_tree_size,
)
from .settings import DraftingSettings, padded_width
from .stats import PEagleGenerationStats, context_bucket
from .tree import DraftTree

PAYS_SMOOTHING = 0.3
"""Weight of the newest drafting round in the running estimate of whether drafting pays (cost rule)."""
PAYS_MARGIN = 0.05
"""Cost rule: drafting continues only while its estimated rate beats a plain step's by this fraction; a smaller
gain is within the cost model's error (its predicted seconds come within a few percent of the measured ones),
and where verifying costs nearly what it returns (a batch of 8 on a CPU) drafting would lose as often as win."""
MAX_SKIP = 32
"""Most plain steps in a row without running the drafter (cost rule); each losing probe doubles the skip."""
CATCH_UP_SLOTS = 64
"""A drafter round over at least this many new slots is a catch-up (the prompt, or a long skip's slots): it times
the drafter's cost per slot, which decides whether a call whose drafting did not pay before drafts at all.  Short
prompts count: a batch of 8 catching up on 120-token prompts takes several plain steps on a CPU."""
PROBE_FIRST, PROBE_EVERY, PROBE_MIN = 4, 64, 3
"""Cost rule: a plain step is taken after `PROBE_FIRST` target passes without one while the curve has fewer
than `PROBE_MIN` observed plain steps, and after `PROBE_EVERY` passes later on, so the plain step's cost (what
every drafting round is compared with) is measured, not only modelled."""


def calibrated_rows(calibration: dict[str, Any] | None, confidences: list[list[float]]) -> list[list[float]]:
    """Per row, the head's calibrated acceptance probabilities of its drafts, before this generation's
    correction (what the correction learns from).  `confidences[depth][row]`."""
    return [calibrated_probabilities(calibration, list(c)) for c in zip(*confidences, strict=True)]


# ---------------------------------------------------------------------------------------------- the contract
@dataclass(frozen=True)
class RoundState:
    """What a policy plans a round from.

    Args:
        context: the target's context at this round's verify pass (tokens per row, padding and holes included).
        max_drafts: the most drafts the longest-running row can still use before `max_length`.
        drafter_context: slots in the drafter's cache.
        pending_slots: the most new real slots a row's drafter round would run over (a catch-up's size).
    """

    context: int
    max_drafts: int
    drafter_context: int
    pending_slots: int


@dataclass(frozen=True)
class RoundPrediction:
    """A round under verification as the cost rule chose it.

    Args:
        calibrated: per row, the calibrated probabilities of the chain drafts it verifies (what the correction
            learns from).
        row_tokens: per row, the tokens the round is expected to emit.
        seconds: the modelled verify seconds plus the drafter's measured ones.
        rate_seconds: the round's modelled seconds (verify plus drafter), for whether drafting pays.
        plain_seconds: a plain step's modelled seconds.
    """

    calibrated: list[list[float]]
    row_tokens: list[float]
    seconds: float
    rate_seconds: float
    plain_seconds: float


@dataclass(frozen=True)
class RoundDrafts:
    """What a drafting round proposed, for its plan to size: `confidences[depth][row]` the head's probability of
    each row's chain drafts, `trees` each row's draft tree (None: chains) and the drafter's measured seconds."""

    confidences: list[list[float]]
    trees: list[DraftTree] | None
    drafter_seconds: float


@dataclass
class RoundPlan:
    """A policy's decision for one round ([`DraftPolicy.plan`]).

    Args:
        context: the target's context the round was planned at.
        skip: a plain step without running the drafter.
        cut: `cut(confidences)`: whether drafting ends after the drafts picked so far (an autoregressive head's
            unroll, the confidence cut); None: never.
        expand: for an autoregressive head's tree, whether one more level pays (None: expand every level).
        choose: `choose(drafts)`: how many drafts (chains) or nodes (trees) every row verifies; 0 declines the
            round (a plain step after the drafter ran).
        prediction: set by `choose` when the cost rule modelled the round.
    """

    context: int
    skip: bool = False
    cut: Callable[[list[list[float]]], bool] | None = None
    expand: Callable[[list[list[float]]], bool] | None = None
    choose: Callable[[RoundDrafts], int] | None = None
    prediction: RoundPrediction | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RoundOutcome:
    """What a round did, as the decoder measured it ([`DraftPolicy.observe`]).

    Args:
        plan: the round's plan.
        verified: drafts or nodes every row verified (0: a plain step).
        accepted: per row of the batch, the drafts it kept.
        counted: the rows that count (ended rows kept idle in the batch do not).
        target_seconds: the verify pass's (or plain step's) measured seconds.
        drafter_seconds: the drafter's measured seconds (0.0 when it did not run).
        drafter_passes: the drafter's forward passes.
        drafter_slots: the new real slots the drafter ran over.
        drafter_context: slots in the drafter's cache before the round.
    """

    plan: RoundPlan
    verified: int
    accepted: list[int]
    counted: list[int]
    target_seconds: float
    drafter_seconds: float = 0.0
    drafter_passes: int = 0
    drafter_slots: int = 0
    drafter_context: int = 0


class DraftPolicy:
    """Every policy's two calls; this base drafts every round and verifies everything it drafted.

    Args:
        settings: the call's settings.
        stats: the call's statistics (the policy counts its own decisions there).
    """

    cost: VerifyCostModel | None = None

    def __init__(self, settings: DraftingSettings, stats: PEagleGenerationStats):
        self.settings, self.stats = settings, stats
        self.idle: set[int] = set()  # rows of the batch that ended and stay only to keep passes fast

    def plan(self, state: RoundState) -> RoundPlan:
        """Before a round: skip the drafter, or how the round's drafts are cut and sized."""
        return RoundPlan(state.context, choose=self._choose_all)

    def observe(self, outcome: RoundOutcome) -> None:
        """After the round's target pass: what it verified and accepted, and the measured seconds."""

    def rows_to_keep(self, live: int, most: int) -> int:
        """How many rows the batch keeps when `live` rows still decode and up to `most` could stay."""
        return live

    def finish(self) -> None:
        """The call ended."""

    def _choose_all(self, drafts: RoundDrafts) -> int:
        if drafts.trees is None:
            return self._count(self.stats.chosen_k_histogram, len(drafts.confidences))
        return self._count(self.stats.tree_size_histogram, self.settings.tree_nodes)

    @staticmethod
    def _count(histogram: list[int], n: int) -> int:
        if n < len(histogram):
            histogram[n] += 1
        return n


class FixedPolicy(DraftPolicy):
    """Threshold 0.0: every round verifies all K drafts (or the full tree), as vLLM does."""


class ThresholdPolicy(DraftPolicy):
    """The confidence cut: a row's round keeps its drafts up to and including the first one whose probability
    under the head is below the threshold (transformers' rule per row); a tree keeps the nodes whose path
    probability reaches it in some row."""

    def plan(self, state: RoundState) -> RoundPlan:
        return RoundPlan(state.context, cut=self._cut, choose=self._choose_cut)

    def _cut(self, confidences: list[list[float]]) -> bool:
        t = self.settings.confidence_threshold
        return all(any(c < t for c in column) for column in zip(*confidences, strict=True))

    def _choose_cut(self, drafts: RoundDrafts) -> int:
        if drafts.trees is None:  # the cut already ended the chain
            return self._choose_all(drafts)
        t = self.settings.confidence_threshold
        n = max(sum(v >= t for v in tree.values) for tree in drafts.trees)
        return self._count(self.stats.tree_size_histogram, n)


class CostPolicy(DraftPolicy):
    """The cost-aware rule (docs/DESIGN.md section 7): per round, the number of drafts or nodes with the best
    expected tokens per second by the machine's measured costs, plain steps that measure a plain step's cost, and
    the drafter skipped while drafting does not pay.

    Args:
        settings, stats: as for [`DraftPolicy`].
        target, head: the call's models (their costs are timed on first use).
        correction: this generation's correction of the calibration.
    """

    def __init__(
        self,
        settings: DraftingSettings,
        stats: PEagleGenerationStats,
        target: Any,
        head: PEagleDrafter,
        correction: AcceptanceCorrection,
    ):
        super().__init__(settings, stats)
        self.target, self.head, self.correction = target, head, correction
        tokens = max(settings.num_speculative_tokens, settings.tree_nodes) + 1
        self.budget = TimingBudget()  # all the timing this call may do (none was asked for)
        self.cost = cost_model_for(target, head, tokens, batch_size=settings.batch_size, budget=self.budget)
        stats.cost_timing_seconds = self.budget.spent
        self._hopeless: tuple[int, bool] | None = None  # (context bucket, whether drafting cannot pay there)
        self._skip_left = 0  # plain steps to take before the drafter runs again
        self._skip_len = 1  # the next skip's length (doubles while drafting keeps losing)
        self._pays: float | None = None  # running ratio of drafting's realised rate to a plain step's
        self._context = 0  # the target's context at the last round planned
        self._since_plain = 0  # target passes since the last plain step (probes)

    # ------------------------------------------------------------------ before a round
    def plan(self, state: RoundState) -> RoundPlan:
        """Time a longer context's costs first when the call's context needs them (once per machine and context,
        within the call's timing budget), then skip the drafter ([`_skips`]) or plan a round sized by the costs
        at this context."""
        self._context = state.context
        if extend_to_context(
            self.cost,
            self.target,
            self.head,
            state.context,
            len(self.cost.verify_seconds),
            self.settings.batch_size,
            self.budget,
        ):
            self.stats.cost_timing_seconds = self.budget.spent
            self._hopeless = None  # the context's costs are known better now
        if self._skips(state):
            return RoundPlan(state.context, skip=True)
        s = self.settings
        autoregressive = s.drafting_mode == "autoregressive"
        drafter = self.cost.drafter_cost(state.drafter_context)
        plan = RoundPlan(state.context)
        plan.choose = lambda drafts: self._choose(plan, drafts, drafter)
        if autoregressive:
            more = lambda confidences: self._one_more_pass_pays(confidences, plan.context, drafter)  # noqa: E731
            plan.cut = lambda confidences: not more(confidences)
            plan.expand = more
        return plan

    def _skips(self, state: RoundState) -> bool:
        """A plain step while drafting cannot pay at this context even at best ([`cannot_pay`]), while a skip
        lasts, to probe a plain step's cost, or for the whole call when drafting did not pay at this context
        before and the catch-up over the prompt would not pay either."""
        if self.cannot_pay(state):
            self.stats.skipped_drafter_rounds += 1
            return True
        if self._skip_left > 0:
            self._skip_left -= 1
            self.stats.skipped_drafter_rounds += 1
            return True
        if self._probe_due():
            self.stats.probe_steps += 1
            return True
        if self._pays is None and self._start_from_memory(state):
            self.stats.skipped_drafter_rounds += 1
            return True
        return False

    def cannot_pay(self, state: RoundState) -> bool:
        """Whether even the head's best case cannot pay at this context: a round verifying n drafts (or nodes), all
        accepted, emits n + 1 tokens per row for the verify pass over n + 1 plus the drafter's round (an
        autoregressive head's: one more pass per draft), and for no n does that beat a plain step's token by
        `PAYS_MARGIN`.  Then the call takes plain steps without the drafter and without probes until the context
        reaches another bucket (decided once per bucket, from the curve at hand)."""
        bucket = context_bucket(state.context)
        if self._hopeless is None or self._hopeless[0] != bucket:
            s, cost = self.settings, self.cost
            most = max(s.num_speculative_tokens, s.tree_nodes)
            curve = self._curve(most + 1, state.context)
            drafter = cost.drafter_cost(state.drafter_context)
            step = cost.drafter_step_seconds if s.drafting_mode == "autoregressive" else 0.0
            best = max(
                (n + 1) / (curve[n] + drafter + step * (min(n, s.num_speculative_tokens) - 1))
                for n in range(1, most + 1)
            )
            self._hopeless = (bucket, best * curve[0] < 1.0 + PAYS_MARGIN)
        return self._hopeless[1]

    def _start_from_memory(self, state: RoundState) -> bool:
        """Before a call's first drafting round: where drafting did not pay at this context in an earlier call,
        skip the drafter for the whole call unless its catch-up over the prompt costs less than `PAYS_MARGIN` of
        the plain steps left (drafting that did not pay is not expected to win more back; a long answer can still
        afford to look again); when it runs, the running estimate starts from that call's.  Returns whether this
        step skips the drafter."""
        remembered = self.cost.remembered_pays(state.context)
        if remembered is None or remembered >= 1.0 + PAYS_MARGIN:
            return False
        catch_up = state.pending_slots * self.cost.drafter_slot_seconds
        if catch_up > PAYS_MARGIN * state.max_drafts * self._cost(1, state.context):
            self._skip_left = state.max_drafts + 1  # the rest of the call
            return True
        self._pays = remembered  # this round drafts: it is the new prompt's first evidence
        return False

    def _probe_due(self) -> bool:
        """Whether this pass should be a plain step to measure one (measured curves only)."""
        if not self.cost.refined_online:
            return False
        few = self.cost.observations[0] < PROBE_MIN
        return self._since_plain >= (PROBE_FIRST if few else PROBE_EVERY)

    def _curve(self, tokens: int, context: int) -> list[float]:
        """The verify seconds for 1..`tokens` per row at `context`, each n priced at the width its pass is padded to
        (`verify_widths`, [`settings.padded_width`]): with widths 1 and K + 1, every drafting round costs a K + 1
        pass."""
        widths = self.settings.verify_widths
        if not widths:
            return self.cost.curve(tokens, context)
        full = self.cost.curve(max(tokens, widths[-1]), context)
        return [full[padded_width(n, widths) - 1] for n in range(1, tokens + 1)]

    def _cost(self, tokens: int, context: int) -> float:
        """The seconds of one verify pass over `tokens` per row at `context`, at the width it is padded to."""
        return self.cost.cost(padded_width(tokens, self.settings.verify_widths), context)

    # ------------------------------------------------------------------ how much a round verifies
    def _one_more_pass_pays(self, confidences: list[list[float]], context: int, drafter: float) -> bool:
        """Whether drafting one more token can raise the expected rate, assuming each row's next draft is as
        likely to be accepted as its last one (an autoregressive head's unroll and tree levels)."""
        rows = [self.correction.apply(row) for row in calibrated_rows(self.settings.calibration, confidences)]
        depth = len(confidences)
        curve = self._curve(depth + 2, context)
        step = self.cost.drafter_step_seconds
        spent = drafter + step * (depth - 1)
        # one more pass only raises the best rate if the rule would verify the extra draft as well
        more = best_batch_rate([r + r[-1:] for r in rows], curve, spent + step)
        return more > best_batch_rate(rows, curve, spent)

    def _choose(self, plan: RoundPlan, drafts: RoundDrafts, drafter: float) -> int:
        """How many drafts (chain) or nodes (tree) every row verifies ([`rule.choose_batch_tree_size`]): the
        expected tokens each further draft adds per row, against the curve at the plan's context and the
        drafter's modelled seconds; the round's prediction goes on the plan."""
        calibrated = calibrated_rows(self.settings.calibration, drafts.confidences)
        if drafts.trees is None:
            gains = [chain_gains(self.correction.apply(row)) for row in calibrated]
            histogram = self.stats.chosen_k_histogram
        else:
            gains = [t.gains() for t in drafts.trees]
            histogram = self.stats.tree_size_histogram
        width = min(len(g) for g in gains)
        curve = self._curve(width + 1, plan.context)
        live = [b for b in range(len(gains)) if b not in self.idle]  # idle rows' tokens count for nothing
        n = self._count(histogram, choose_batch_tree_size([gains[b] for b in live], curve, drafter))
        if n == 0:
            self.stats.declined_rounds += 1
            return 0
        if drafts.trees is None:
            verified = [n] * len(calibrated)
        else:
            verified = [sum(t.chain[:n]) for t in drafts.trees]
        plan.prediction = RoundPrediction(
            calibrated=[c[:m] for c, m in zip(calibrated, verified)],
            row_tokens=[1.0 + sum(g[:n]) for g in gains],
            seconds=curve[n] + drafts.drafter_seconds,
            rate_seconds=curve[n] + drafter,
            plain_seconds=curve[0],
        )
        return n

    # ------------------------------------------------------------------ after the round
    def observe(self, outcome: RoundOutcome) -> None:
        """The measured passes into the cost model and the stats, then whether drafting pays: a declined round
        counts the drafter's seconds against a plain step's; a verified one the tokens it realised per row, at
        its modelled seconds, against a plain step's one token (the calibration's promise does not count here,
        the outcome does)."""
        plan, cost = outcome.plan, self.cost
        n = padded_width(outcome.verified + 1, self.settings.verify_widths)  # the width the pass ran with
        r = plan.prediction
        if outcome.drafter_slots >= CATCH_UP_SLOTS:
            cost.observe_catch_up(outcome.drafter_seconds, outcome.drafter_slots)
        elif outcome.drafter_passes:
            cost.observe_drafter(outcome.drafter_seconds, outcome.drafter_passes - 1, outcome.drafter_context)
        predicted = cost.cost(n, plan.context) if r is None else r.rate_seconds
        measured = outcome.target_seconds + (r is not None) * outcome.drafter_seconds
        cost.observe_verify(n, outcome.target_seconds, plan.context)
        if r is not None:
            self.stats.predicted_seconds += r.seconds
            self.stats.measured_seconds += measured
        self.stats.observe_pass(plan.context, self.settings.batch_size, predicted, measured)
        if outcome.verified == 0:
            cost.observe_rows(len(outcome.accepted), outcome.target_seconds, plan.context)
            self._since_plain = 0
            if (
                outcome.drafter_passes
            ):  # declined: the drafter's time spent for nothing, against a plain step's
                plain = self._cost(1, plan.context)
                self._fold_pays(plain / (plain + outcome.drafter_seconds))
            return
        self._since_plain += 1
        rows = len(outcome.counted)
        if r is None or not rows:
            return
        kept = sum(outcome.accepted[b] for b in outcome.counted)
        self.stats.predicted_tokens += sum(r.row_tokens[b] for b in outcome.counted)
        self.stats.realised_tokens += kept + rows
        self._fold_pays((kept + rows) / rows / r.rate_seconds * r.plain_seconds)

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

    def rows_to_keep(self, live: int, most: int) -> int:
        """The count whose plain step the cost model knows to be cheapest (ties: fewer): the row counts' plain-step
        seconds from `peagle calibrate --costs` or learnt from the plain steps calls ran at each count
        ([`VerifyCostModel.observe_rows`]); nothing is timed for it in a call.  `live` while a count is unknown."""
        if not self.cost.refined_online or most <= live:
            return live
        seconds = {count: self.cost.row_seconds.get(str(count)) for count in range(live, most + 1)}
        if any(value is None for value in seconds.values()):
            return live
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
    correction: AcceptanceCorrection,
) -> DraftPolicy:
    """The call's policy, by `settings.policy`."""
    if settings.policy == "cost":
        return CostPolicy(settings, stats, target, head, correction)
    if settings.policy == "threshold":
        return ThresholdPolicy(settings, stats)
    return FixedPolicy(settings, stats)


__all__ = [
    "CostPolicy",
    "DraftPolicy",
    "FixedPolicy",
    "RoundDrafts",
    "RoundOutcome",
    "RoundPlan",
    "RoundPrediction",
    "RoundState",
    "ThresholdPolicy",
    "make_policy",
]
