"""The drafting side of peagle's decoding loop ([`decoding.peagle_decoding`]): one P-EAGLE (or EAGLE-3-style) round
per verify pass for every row of a batch, through [`PEagleDrafter.draft_round`] ([`DraftingSession`]).

Its parts, each in its own module: the call's settings resolved once ([`settings.DraftingSettings`]), the
drafter's KV cache with its pending slots and holes ([`drafter_cache.DrafterCache`]), per-row logits processing
and the round's selector ([`processing`]), and the drafting policy that decides how much a round verifies and
whether the drafter runs at all ([`policy`]).  Every round hands the loop one [`DraftCandidates`]: a chain per row,
or a draft tree per row (docs/DESIGN.md sections 3, 10 and 11).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList

from ..modeling_peagle import PEagleDrafter
from .drafter_cache import DrafterCache, SlotBlock
from .policy import RoundDrafts, RoundOutcome, RoundPlan, RoundState, make_policy
from .processing import draft_selector, read_together
from .rule import AcceptanceCorrection
from .sampling import KeyedSampler
from .settings import DraftingOptions, DraftingSettings, padded_width
from .stats import PEagleGenerationStats
from .tree import DraftCandidates, DraftTree, LookupEstimate, NgramIndex, grow_tree, grow_tree_from_pool
from .tree_drafting import LevelSelector, candidate_tensors, parallel_candidates

_ATTACHED_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DraftingSession:
    """Drafts up to K tokens (or tree nodes) per row per round with a [`PEagleDrafter`], for B >= 1 rows, for one
    `generate()` call.

    The loop asks the target's verify passes for the hidden states in `model_kwargs_overrides`, hands each row's
    new real slots to [`add_real_slots`], calls [`propose`] for the round's candidates and reports the verified
    outcome, with the seconds its target pass took, to [`verified`].  Finished rows leave through [`select_rows`].
    Each round asks the call's policy twice: [`policy.DraftPolicy.plan`] before it and
    [`policy.DraftPolicy.observe`] after it (docs/DESIGN.md section 7).

    Args:
        target: the target model running `generate()`.
        head: the drafter.
        generation_config: the call's prepared generation config (K, sampling, the confidence cut).
        logits_processor: the processors applied to the target's logits; applied to the draft logits too
            (temperature, top-k, top-p, penalties), each row with its own history, so drafts follow the same
            rules.
        batch_size: rows decoded together (the cost rule's curve is measured for this many rows).
        options: peagle's own `generate()` options (trees, prompt lookup, the drafter window, a round observer).
        sampler: the call's keyed sampler when sampling ([`sampling.KeyedSampler`]): drafts use the noise the
            target's draw at their position will use.
        resume: the drafter cache an earlier call left on the target's cache ([`resume`]); a new one when None.
        clock: the clock the drafter's passes are timed with (the decoding loop's own).
    """

    def __init__(
        self,
        target: Any,
        head: PEagleDrafter,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        batch_size: int = 1,
        options: DraftingOptions | None = None,
        sampler: KeyedSampler | None = None,
        resume: DrafterCache | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        options = options or DraftingOptions()
        self.sampler, self.clock = sampler, clock
        self._start = clock()  # total_seconds includes any cost timing the policy does first
        self.processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.settings = s = DraftingSettings.resolve(
            target, head, generation_config, options, batch_size, len(self.processors)
        )
        self.head, self.observer, self.device = head, options.round_observer, head.device
        # the user asked for every hidden state: request them all (the aux layers are among them)
        self.model_kwargs_overrides: dict[str, Any] = {
            "output_hidden_states": True if s.all_hidden_states else list(s.aux_layer_ids)
        }
        if head.config.embed_from_target:
            weight = target.get_input_embeddings().weight
            ref = _ATTACHED_EMBEDDINGS.get(head)
            if head.embed_tokens.weight is not weight and (ref is None or ref() is not weight):
                head.attach_target(target)
                _ATTACHED_EMBEDDINGS[head] = weakref.ref(weight)
        k = s.num_speculative_tokens
        self.stats = PEagleGenerationStats(
            drafting_mode=s.drafting_mode,
            num_speculative_tokens=k,
            accepted_per_depth=[0] * k,
            drafted_per_depth=[0] * k,
            confidence_threshold=s.confidence_threshold,
            draft_policy=s.policy,
            chosen_k_histogram=[0] * (k + 1),
            batch_size=s.batch_size,
            draft_tree_size=s.tree_nodes,
            tree_size_histogram=[0] * (s.tree_nodes + 1) if s.tree_nodes else [],
        )
        self.resumed = resume is not None and resume.window == s.window and resume.rows == s.batch_size
        self.cache = resume if self.resumed else DrafterCache(head, s.batch_size, s.window)
        self.correction = AcceptanceCorrection()  # the calibration as this generation's rounds bear it out
        self.policy = make_policy(s, self.stats, target, head, self.correction)
        self._lookup = LookupEstimate()  # prompt-lookup tokens' acceptance as this generation bears it out
        self._indexes: dict[int, NgramIndex] = {}  # per original row: its tokens for prompt lookup
        self._last_num_drafts = 0
        # the round under verification: its plan, the drafter's measured run, and [depth][row] the head's
        # confidence in its chain drafts
        self._plan: RoundPlan | None = None
        # the drafter's run this round: seconds, passes, new real slots, the drafter's context before it
        self._drafter_run = (0.0, 0, 0, 0)
        self._confidences: list[list[float]] = []
        self._trees: list[DraftTree] | None = None  # the trees under verification
        self._nodes = s.tree_nodes  # the most tree nodes this round (fewer where a pass has no room)
        head.last_generation_stats = self.stats

    # ------------------------------------------------------------------ rows and slots
    @property
    def rows(self) -> int:
        """Rows still decoding."""
        return self.cache.rows

    @property
    def tree_nodes(self) -> int:
        """The most tree nodes per row and round (0: chains)."""
        return self.settings.tree_nodes

    def add_real_slots(self, row: int, tokens: torch.LongTensor, features: torch.Tensor, start: int) -> None:
        """Queue row `row`'s new real slots ([`DrafterCache.add_real_slots`])."""
        self.cache.add_real_slots(row, tokens, features, start)

    def add_shared_slots(self, tokens: torch.LongTensor, features: torch.Tensor, starts: list[int]) -> None:
        """Queue the same number of new real slots for every row ([`DrafterCache.add_shared_slots`])."""
        self.cache.add_shared_slots(tokens, features, starts)

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices into the current rows; finished rows leave the batch)."""
        self.cache.select_rows(keep)

    def rows_to_keep(self, live: int, most: int) -> int:
        """How many rows the batch should keep when `live` rows still decode and up to `most` could stay (the
        others idle): the count whose plain step the cost model measures cheapest; `live` without the cost rule's
        measured curves."""
        return self.policy.rows_to_keep(live, most)

    def set_idle(self, idle: list[bool]) -> None:
        """Which rows of the batch are ended rows kept idle (their drafts count for nothing in the rule)."""
        self.policy.idle = {b for b, flag in enumerate(idle) if flag}

    def disable_trees(self) -> None:
        """Verify chains from now on (the target cannot verify trees; the loop says why when trees were asked
        for)."""
        self.settings = self.policy.settings = self.settings.without_trees()
        self.stats.draft_tree_size = 0
        self.stats.tree_size_histogram = []

    # ------------------------------------------------------------------ one round
    def prefill_next(self) -> DraftCandidates:
        """The prefill runs next: a plain step for every row, with nothing to draft from yet (no round to plan or
        observe)."""
        self._plan = None
        return self._plain_step()

    @torch.no_grad()
    def propose(
        self,
        histories: list[torch.LongTensor],
        max_drafts: int,
        rows: list[int] | None = None,
        host_histories: list[list[int]] | None = None,
        max_nodes: int | None = None,
    ) -> DraftCandidates:
        """Draft up to `max_drafts` (<= K) tokens after each row's history.

        Args:
            histories: per row, `(1, L_b)` the tokens plain `generate()` would show the logits processors (the
                left-padded prompt and the row's tokens so far).
            max_drafts: the most drafts the longest-running row can still use before `max_length`.
            rows: each row's index in the call's original batch (rows leave the batch when they end); default
                0..B-1.
            host_histories: the same tokens on the host, per row (prompt lookup reads them; read from
                `histories` when None).
            max_nodes: the most tree nodes the verify pass has room for (a static cache's slots); default the
                tree budget.

        Returns:
            [`DraftCandidates`]: a chain of k drafts or a tree of k nodes per row, the same k for every row; k = 0
            at the length limit and, under the cost rule, in rounds where verifying drafts is not expected to pay.
        """
        rows = list(range(len(histories))) if rows is None else rows
        state = RoundState(
            context=max(h.shape[1] for h in histories),
            max_drafts=max_drafts,
            drafter_context=self.cache.length,
            pending_slots=self.cache.pending_slots(),
        )
        self._drafter_run = (0.0, 0, 0, state.drafter_context)
        k = min(self.settings.num_speculative_tokens, max_drafts)
        nodes = self.settings.tree_nodes
        self._nodes = nodes if max_nodes is None else min(nodes, max_nodes)
        if k < 1:  # no room for a draft: a plain step, nothing to decide
            self._plan = RoundPlan(state.context, skip=True)
            return self._plain_step()
        self._plan = plan = self.policy.plan(state)
        if plan.skip:
            return self._plain_step()
        if host_histories is None:
            host_histories = [h[0].tolist() for h in histories] if self.settings.lookup_tokens else []
        block = self.cache.next_block()
        if self.settings.tree_nodes and self.settings.drafting_mode == "autoregressive":
            return self._expand_tree(block, rows, host_histories, k)
        drafts, confidences, trees, drafter_seconds = self._draft_chains(
            block, histories, rows, host_histories, k, max_drafts
        )
        if trees is not None:
            return self._tree_candidates(trees, confidences, drafter_seconds)
        if drafts.shape[1] > 0:
            keep = plan.choose(RoundDrafts(confidences, None, drafter_seconds))
            drafts = drafts[:, :keep]
        num = drafts.shape[1]
        if num == 0:
            return self._plain_step()
        self._last_num_drafts = num
        self.stats.draft_tokens += num * self.rows
        if num < k:
            self.stats.truncated_rounds += self.rows
        for d in range(num):
            self.stats.drafted_per_depth[d] += self.rows
        return DraftCandidates.chain(drafts)

    def _draft_chains(
        self,
        block: SlotBlock,
        histories: list[torch.LongTensor],
        rows: list[int],
        host_histories: list[list[int]],
        k: int,
        max_drafts: int,
    ) -> tuple[torch.LongTensor, list[list[float]], list[DraftTree] | None, float]:
        """The drafter's round through [`processing.draft_selector`]: `(drafts (B, k'), confidences[depth][row],
        each row's tree or None, the drafter's seconds)`.  The round's figures (the drafts' probabilities, and for
        trees the head's top tokens per depth) are read on the host in one read (an autoregressive head's
        probabilities only where its cut read them already); a parallel head's cut is applied after its one pass."""
        plan = self._plan
        self._confidences = confidences = []  # filled by the selector where a cut reads each depth
        probabilities: list[torch.Tensor] = []
        parallel = self.settings.drafting_mode != "autoregressive"
        select = draft_selector(
            self.head,
            self.processors,
            self.settings.do_sample,
            [h.to(self.device) for h in histories],
            rows,
            self.settings.batch_size,
            probabilities,
            confidences,
            None if parallel else plan.cut,
            self.sampler,
        )
        whole = getattr(select, "whole_round", None)
        if whole is not None and self.settings.tree_nodes:  # it keeps the round's top tokens for the trees
            whole.tree = True
        tic = self.clock()
        draft = self.head.draft_round(
            block.tokens, block.features, k, self.cache.cache, block.start, select, block.attention_mask
        )
        drafter_seconds = self._drafter_ran(block, draft.forward_calls, tic)
        self.cache.appended(block, draft.speculative_slots)
        drafts = draft.tokens
        trees = None
        if drafts.shape[1] > 0:  # the round's figures, read on the host at once
            wanted = [] if confidences else [torch.stack(probabilities)]
            if self.settings.tree_nodes:
                top = None if whole is None else whole.top  # None where the round did not call it
                wanted += [drafts, *(top if top is not None else candidate_tensors(draft, self.head))]
            held = self.cache.most_valid  # the drafter cache's next compaction check, read along
            read = read_together(wanted + ([held] if held is not None else []))
            if held is not None:
                self.cache.most_valid_read = read.pop()
            if not confidences:
                self._confidences = confidences = read.pop(0)
            if parallel and plan.cut is not None:  # the cut, applied after the round's one pass
                depth = next((d + 1 for d in range(len(confidences)) if plan.cut(confidences[: d + 1])), None)
                if depth is not None:
                    self._confidences = confidences = confidences[:depth]
                    drafts, read = drafts[:, :depth], [_upto(r, depth) for r in read]
            if self.settings.tree_nodes:
                trees = self._grow_trees(read, confidences, rows, host_histories, max_drafts)
        return drafts, self._confidences, trees, drafter_seconds

    def fixed_width(self, candidates: DraftCandidates, room: int | None = None) -> DraftCandidates:
        """The candidates padded to the smallest of the call's `verify_widths` that holds them (and fits `room`
        slots), with nodes the target never accepts (docs/DESIGN.md section 10.2); as they are when none does."""
        width = padded_width(len(candidates) + 1, self.settings.verify_widths, room)
        return candidates.padded(width - 1) if width > len(candidates) + 1 else candidates

    def _drafter_ran(self, block: SlotBlock, passes: int, tic: float) -> float:
        """Count the round's drafter passes and time them (since `tic`); returns the drafter's seconds."""
        self.stats.drafter_forward_calls += passes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = self.clock() - tic
        self.stats.drafter_seconds += seconds
        self._drafter_run = (seconds, passes, block.tokens.shape[1], self._drafter_run[3])
        return seconds

    def _plain_step(self) -> DraftCandidates:
        self._last_num_drafts = 0
        return DraftCandidates.chain(torch.zeros(self.rows, 0, dtype=torch.long, device=self.device))

    def finish(self) -> None:
        """The call ended (the cost rule keeps what it learnt)."""
        self.policy.finish()

    # ------------------------------------------------------------------ trees
    def _grow_trees(
        self,
        candidates: list[Any],
        confidences: list[list[float]],
        rows: list[int],
        histories: list[list[int]],
        max_drafts: int,
    ) -> list[DraftTree]:
        """One tree per row from the round's per-depth candidates (`[drafted, top ids, top probabilities]` read on
        the host) plus its prompt-lookup branch."""
        trees = []
        drafted, ids, head_p = candidates
        per_row = parallel_candidates(
            ids, head_p, drafted, confidences, self.settings.calibration, self.correction
        )
        for b, cands in enumerate(per_row):
            lookup = self._lookup_branch(rows[b], histories, b, max_drafts)
            trees.append(
                grow_tree(
                    cands,
                    self._nodes,
                    lookup,
                    self._lookup.probabilities(len(lookup)),
                    chain_parents_only=self.settings.drafting_mode == "autoregressive",
                )
            )
        return trees

    def _expand_tree(
        self, block: SlotBlock, rows: list[int], histories: list[list[int]], depth_limit: int
    ) -> DraftCandidates:
        """An autoregressive head's round with trees: EAGLE-2's level-by-level expansion through the head's own
        round ([`tree_drafting.LevelSelector`]), then each row's tree picked best-first from its candidates plus
        its prompt-lookup branch."""
        s = self.settings
        real = torch.cat([self.cache.mask, block.new_mask], dim=1)
        select = LevelSelector(
            self.head, real, depth_limit, s.calibration, self.correction, self._plan.expand
        )
        tic = self.clock()
        draft = self.head.draft_round(
            block.tokens,
            block.features,
            depth_limit,
            self.cache.cache,
            block.start,
            select,
            block.attention_mask,
        )
        drafter_seconds = self._drafter_ran(block, draft.forward_calls, tic)
        self.cache.appended(block, draft.speculative_slots)
        self._confidences = confidences = select.confidences
        trees = []
        for b, pool in enumerate(select.pools):
            lookup = self._lookup_branch(rows[b], histories, b, depth_limit)
            trees.append(
                grow_tree_from_pool(
                    pool.tokens,
                    pool.parents,
                    pool.probs,
                    pool.chain,
                    self._nodes,
                    lookup,
                    self._lookup.probabilities(len(lookup)),
                )
            )
        return self._tree_candidates(trees, confidences, drafter_seconds)

    def _lookup_branch(self, row: int, histories: list[list[int]], b: int, max_drafts: int) -> list[int]:
        """Row `b`'s prompt-lookup branch (`row`: its index in the call's batch, whose n-gram index is kept)."""
        n = self.settings.lookup_tokens
        if not n:
            return []
        index = self._indexes.setdefault(row, NgramIndex())
        index.sync(histories[b])
        return index.lookup(min(n, max_drafts))

    def _tree_candidates(
        self, trees: list[DraftTree], confidences: list[list[float]], drafter_seconds: float
    ) -> DraftCandidates:
        """The round's trees, all of one size (padded), or a plain step when the plan verifies no node."""
        n = min(self._plan.choose(RoundDrafts(confidences, trees, drafter_seconds)), self._nodes)
        if n == 0:
            return self._plain_step()
        trees = [t.truncated(n).preordered() for t in trees]  # the best path first: kept by a crop
        self._trees = trees
        self._last_num_drafts = n
        self.stats.draft_tokens += n * self.rows
        self.stats.tree_rounds += self.rows
        for t in trees:
            for d in sorted({d for d, p in zip(t.depths, t.parents) if p != -2}):
                _bump(self.stats.drafted_per_depth, d - 1)
        return DraftCandidates.of_trees(trees, self.device)

    # ------------------------------------------------------------------ after the verify pass
    def verified(
        self,
        accepted: list[int],
        live: list[bool] | None = None,
        paths: list[list[int]] | None = None,
        target_seconds: float = 0.0,
    ) -> None:
        """Record the round just verified: per row, the drafts kept (after EOS and `max_length` cut the row); each
        row also emitted one token of the target's own.  `paths`: the slots of each row's accepted path (root
        first).  Rows marked not `live` (ended rows kept idle in the batch) count nowhere.  `target_seconds`: what
        the loop measured for the round's target pass.  The round's outcome goes to the policy."""
        stats = self.stats
        trees, self._trees = self._trees, None
        counted = [b for b in range(len(accepted)) if live is None or live[b]]
        kept = sum(accepted[b] for b in counted)
        rows = len(counted)
        plan = self._plan
        if self._last_num_drafts > 0:
            prediction = plan.prediction if plan is not None else None
            for b in counted:
                matches = chain_matches = accepted[b]
                if trees is not None:  # the chain's and the lookup branch's share of the accepted path
                    nodes = [slot - 1 for slot in paths[b][1 : matches + 1]]
                    chain_matches = _leading(trees[b].chain, nodes)
                    on_branch = sum(trees[b].lookup)
                    if on_branch:
                        hit = _leading(trees[b].lookup, nodes)
                        self._lookup.observe(min(on_branch, hit + 1), hit)
                elif self.observer is not None:
                    self.observer([depth[b] for depth in self._confidences[: self._last_num_drafts]], matches)
                for d in range(matches):
                    _bump(stats.accepted_per_depth, d)
                if prediction is not None:
                    self.correction.observe(prediction.calibrated[b], chain_matches)
            stats.rounds += rows
            stats.accepted_tokens += kept
        else:
            stats.plain_steps += rows
        if plan is not None:
            seconds, passes, slots, context = self._drafter_run
            self.policy.observe(
                RoundOutcome(
                    plan,
                    self._last_num_drafts,
                    accepted,
                    counted,
                    target_seconds,
                    seconds,
                    passes,
                    slots,
                    context,
                )
            )
            self._plan = None
        stats.target_batch_passes += 1
        stats.generated_tokens += kept + rows
        stats.total_seconds = self.clock() - self._start


def _upto(values: list[list[Any]], depth: int) -> list[list[Any]]:
    """Per row, the first `depth` entries."""
    return [row[:depth] for row in values]


def _leading(flags: list[bool], nodes: list[int]) -> int:
    """How many of the path's first nodes carry the flag (the chain and the lookup branch are paths from the
    root, so the path follows one for a prefix)."""
    count = 0
    for node in nodes:
        if not flags[node]:
            break
        count += 1
    return count


def _bump(counts: list[int], index: int) -> None:
    """`counts[index] += 1`, growing the list (a lookup branch may reach deeper than K)."""
    while len(counts) <= index:
        counts.append(0)
    counts[index] += 1


__all__ = ["DraftingSession"]
