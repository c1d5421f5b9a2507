"""The drafting side of peagle's decoding loop ([`decoding.peagle_decoding`]): one P-EAGLE round per verify pass,
for a batch of B >= 1 rows.

After a verify pass, row b's sequence is x_0..x_{n-1}; the target features f_0..f_{n-2} are known and x_{n-1} is
the bonus token.  The drafter's KV cache holds each row's real slots from earlier rounds, then the previous
round's speculative slots (the same number in every row).  The loop hands over each row's new real slots (slot
t = embed(x_{t+1}) + fc(f_t) at position t: the accepted drafts and the bonus, paired with the verify pass's
features); rows accept different numbers of drafts, so a round's block of new real slots is ragged and is
left-padded with masked holes.  Each round crops the speculative slots away, then runs
[`PEagleDrafter.draft_round`] on the block.  docs/DESIGN.md sections 3 and 10 have the slot layout.
"""

from __future__ import annotations

import numbers
import time
import weakref
from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.configuration_utils import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.utils import logging

from ..configuration_peagle import MAX_SPECULATIVE_TOKENS, default_aux_layer_ids
from ..modeling_peagle import PEagleDrafter
from ..sizing.target_config import text_config
from .cost import cost_model_for, ensure_row_seconds, extend_to_context, persist_cost_model
from .ragged import compact, drop_oldest, worth_compacting
from .rule import (
    AcceptanceCorrection,
    best_batch_rate,
    calibrated_probabilities,
    chain_gains,
    choose_batch_tree_size,
)
from .stats import PEagleGenerationStats
from .tree import (
    DraftCandidates,
    DraftTree,
    LookupEstimate,
    grow_tree,
    grow_tree_from_pool,
    prompt_lookup,
)
from .tree_drafting import expand_autoregressive_tree, parallel_candidates

logger = logging.get_logger(__name__)

_clock = time.perf_counter
"""The generator's clock (the cost rule times the passes it observes with it; tests replace it)."""

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
AUTO_TREE_NODES = 32
"""`draft_tree_size="auto"`: the most draft nodes the cost rule may verify per row and round."""
MAX_TREE_NODES = 256
"""The largest `draft_tree_size` accepted (verifying more per round is never worth it)."""
DEFAULT_LOOKUP_TOKENS = 10
"""Prompt-lookup branch length when trees are on and `prompt_lookup_num_tokens` is not given."""


def _given(generation_config: GenerationConfig, name: str) -> Any:
    """`generation_config.<name>` when the user set it, else None.

    transformers fills unset values with its global defaults before decoding starts; peagle's hook records which
    names the user passed to `generate()` (`_peagle_given`), so a value equal to the default (e.g.
    `num_assistant_tokens=20`) still counts as given.  Without that record (a `GenerationConfig` passed whole),
    a value equal to transformers' default reads as "not given"."""
    value = getattr(generation_config, name)
    given = getattr(generation_config, "_peagle_given", None)
    if given is not None and name in given:
        return value
    default = GenerationConfig._get_default_generation_params().get(name)
    return None if value is None or value == default else value


def resolve_num_speculative_tokens(generation_config: GenerationConfig, head: PEagleDrafter) -> int:
    """K for one `generate()` call: `num_assistant_tokens` when given, else `head.config.num_speculative_tokens`.

    `num_assistant_tokens=20` passed to `generate()` means K=20 even though it equals transformers' default.
    """
    requested = _given(generation_config, "num_assistant_tokens")
    k = head.config.num_speculative_tokens if requested is None else requested
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_assistant_tokens (K) is {k!r}; expected an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
            "(drafts past that depth are never accepted, and measuring their cost would take minutes)."
        )
    return k


def resolve_confidence_threshold(
    generation_config: GenerationConfig, head: PEagleDrafter | None = None
) -> float | None:
    """The draft-confidence cut for one `generate()` call, or None for cost-aware drafting.

    `assistant_confidence_threshold` when given, else the head's `config.confidence_threshold`; None when neither
    is set (a head's default), which selects the cost-aware rule (docs/DESIGN.md section 7).  Without a head:
    0.0.  With a threshold `t > 0`, a row's round keeps its drafts up to and including the first one whose
    probability under the head is below `t` (the rule of transformers' `ConfidenceCriteria` for draft models);
    0.0 drafts all K tokens every round, as vLLM does.  The output is unchanged either way (greedy: identical;
    sampling: same distribution), only the work per round changes.  transformers fills an unset threshold with
    its global default (0.4); an explicit 0.4 passed to `generate()` still counts as given.
    """
    value = _given(generation_config, "assistant_confidence_threshold")
    if value is None:
        if head is None:
            return 0.0
        own = head.config.confidence_threshold
        return None if own is None else float(own)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # True or "0.5" are not probabilities
        raise ValueError(
            f"assistant_confidence_threshold is {value!r} ({type(value).__name__}); expected a number in [0, 1]."
        )
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"assistant_confidence_threshold is {value!r}; expected a probability in [0, 1].")
    return value


def resolve_tree_settings(
    tree_size: int | str | None, lookup_tokens: int | None, policy: str
) -> tuple[int, int]:
    """`(most draft nodes per round, prompt-lookup branch length)` for one `generate()` call; 0 nodes means
    chains.

    `draft_tree_size="auto"` (the default, also for None) verifies trees of up to [`AUTO_TREE_NODES`] nodes under
    the cost rule and chains under a fixed threshold or K (as before trees), unless prompt-lookup branches are
    asked for; an integer N caps the nodes (0: chains only).  `prompt_lookup_num_tokens` sets the branch length
    (default [`DEFAULT_LOOKUP_TOKENS`] with trees; 0: no branch); it needs trees.

    >>> resolve_tree_settings("auto", None, "cost"), resolve_tree_settings("auto", None, "fixed")
    ((32, 10), (0, 0))
    """
    if lookup_tokens is not None and (
        isinstance(lookup_tokens, bool) or not isinstance(lookup_tokens, int) or lookup_tokens < 0
    ):
        raise ValueError(f"prompt_lookup_num_tokens is {lookup_tokens!r}; expected an integer >= 0.")
    if tree_size is None or tree_size == "auto":
        wants_lookup = bool(lookup_tokens)
        nodes = AUTO_TREE_NODES if policy == "cost" or wants_lookup else 0
    elif (
        isinstance(tree_size, bool) or not isinstance(tree_size, int) or not 0 <= tree_size <= MAX_TREE_NODES
    ):
        raise ValueError(
            f'draft_tree_size is {tree_size!r}; expected "auto" or an integer in [0, {MAX_TREE_NODES}] '
            "(0: verify chains only)."
        )
    else:
        nodes = tree_size
    if nodes == 0 and lookup_tokens:
        raise ValueError(
            f"prompt_lookup_num_tokens={lookup_tokens} adds a branch to draft trees, but draft_tree_size=0 asks for "
            'chains only; use draft_tree_size="auto" or N > 0.'
        )
    lookup = (DEFAULT_LOOKUP_TOKENS if lookup_tokens is None else lookup_tokens) if nodes else 0
    return nodes, lookup


def resolve_drafter_window(window: Any, head: PEagleDrafter) -> int | None:
    """The drafter's attention window for one `generate()` call: `drafter_window` when given (a keyword or the
    generation config's attribute), else the head's `config.drafter_window`; None or 0 attends over the whole
    context.  With a window W, every drafting round first drops the drafter's cached slots older than the last W
    (counting the round's new real slots), so the head never attends further back than it was trained to and its
    rounds stop growing with the context; the target still verifies against the whole context, so the output is
    unchanged (docs/DESIGN.md section 3.2)."""
    if window is None:
        window = getattr(head.config, "drafter_window", None)
    if window is None or (window == 0 and not isinstance(window, bool)):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"drafter_window is {window!r}; expected an integer >= 1 (the drafter's slots attended to), or 0 / "
            "None for the whole context."
        )
    return window


def grouped_processing(
    processors: LogitsProcessorList,
    histories: list[torch.LongTensor],
    scores: torch.Tensor,
    rows: list[int] | None = None,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Apply `processors` to each row's `(V,)` scores with that row's own history, as plain `generate()` would.

    Rows of a ragged batch sit at different lengths.  Rows whose histories have one length go through the
    processors together, each at its place in the original batch (`rows[b]` of `batch_size`; the other places
    repeat one of the group's histories), so a processor sees each row's own length (`min_new_tokens`) and its
    batch index (per-row state such as the repetition penalty's prompt padding, `prefix_allowed_tokens_fn`).
    `histories[b]` is `(1, L_b)`; returns the processed `(B, V)` scores."""
    if len(processors) == 0:
        return scores
    rows = list(range(len(histories))) if rows is None else rows
    batch_size = len(histories) if batch_size is None else batch_size
    out = scores.clone()
    groups: dict[int, list[int]] = {}
    for b, h in enumerate(histories):
        groups.setdefault(h.shape[1], []).append(b)
    for members in groups.values():
        first = histories[members[0]].to(scores.device)
        ctx = first.expand(batch_size, -1).clone()
        full = scores[members[0]].expand(batch_size, -1).clone()
        for b in members:
            ctx[rows[b]] = histories[b][0].to(scores.device)
            full[rows[b]] = scores[b]
        done = processors(ctx, full)
        for b in members:
            out[b] = done[rows[b]]
    return out


# ---------------------------------------------------------------------------------------------- generator
_ATTACHED_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PEagleCandidateGenerator:
    """Drafts up to K tokens per row per round with a [`PEagleDrafter`], for B >= 1 rows.

    Built by peagle's decoding loop when `generate()` gets a P-EAGLE head as `assistant_model`.  The loop asks the
    target's verify passes for the hidden states of `config.eagle_aux_hidden_state_layer_ids`
    (`model_kwargs_overrides`), hands each row's new real slots to [`add_real_slots`], calls [`get_candidates`]
    for the round's drafts and reports the verified outcome to [`update_candidate_strategy`].  Finished rows leave
    through [`select_rows`].

    Args:
        target: the target model running `generate()`.
        head: the drafter.
        generation_config: the call's generation config (K, sampling, `max_length`).
        logits_processor: the processors applied to the target's logits; applied to the draft logits too
            (temperature, top-k, top-p, penalties), each row with its own history, so drafts follow the same
            rules.
        batch_size: rows decoded together (the cost rule's curve is measured for this many rows).
    """

    def __init__(
        self,
        target: Any,
        head: PEagleDrafter,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        batch_size: int = 1,
        tree_size: int | str | None = None,
        lookup_tokens: int | None = None,
        drafter_window: int | None = None,
    ):
        cfg = head.config
        tc = text_config(target)
        self.head = head
        self.drafting_mode = cfg.drafting_mode
        self.num_target_layers = int(tc.num_hidden_layers)
        self.aux_layer_ids = list(
            cfg.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(self.num_target_layers)
        )
        self.num_speculative_tokens = resolve_num_speculative_tokens(generation_config, head)
        threshold = resolve_confidence_threshold(generation_config, head)
        self.policy = "cost" if threshold is None else ("threshold" if threshold > 0 else "fixed")
        self.confidence_threshold = threshold or 0.0
        self.calibration = getattr(cfg, "draft_calibration", None)
        self.batch_size = int(batch_size)
        self.tree_nodes, self.lookup_tokens = resolve_tree_settings(tree_size, lookup_tokens, self.policy)
        self.window = resolve_drafter_window(drafter_window, head)
        self.target = target
        self.idle: set[int] = set()  # rows of the batch that ended and stay only to keep passes fast
        self.cost = (
            cost_model_for(
                target,
                head,
                max(self.num_speculative_tokens, self.tree_nodes) + 1,
                batch_size=self.batch_size,
            )
            if self.policy == "cost"
            else None
        )
        if self.drafting_mode == "parallel" and self.num_speculative_tokens > cfg.num_parallel_positions:
            logger.warning_once(
                f"drafting K={self.num_speculative_tokens} tokens per round with a head trained for "
                f"{cfg.num_parallel_positions} parallel positions; deeper drafts are rarely accepted."
            )
        # the user asked for every hidden state: request them all (the aux layers are among them)
        all_states = bool(generation_config.output_hidden_states)
        self.model_kwargs_overrides: dict[str, Any] = {
            "output_hidden_states": True if all_states else list(self.aux_layer_ids)
        }
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        # greedy verification compares tokens only: with no processors to apply, drafts and their probabilities
        # come straight from the draft vocabulary and no target-vocabulary logits go back to the loop
        self.fast_greedy = not self.do_sample and len(self.logits_processor) == 0
        self.max_length = generation_config.max_length
        self.device = head.device
        if cfg.embed_from_target:
            weight = target.get_input_embeddings().weight
            ref = _ATTACHED_EMBEDDINGS.get(head)
            if head.embed_tokens.weight is not weight and (ref is None or ref() is not weight):
                head.attach_target(target)
                _ATTACHED_EMBEDDINGS[head] = weakref.ref(weight)

        self.cache = DynamicCache(config=cfg)
        self.cache_mask = torch.ones(self.batch_size, 0, dtype=torch.long, device=self.device)
        self.has_holes = False  # whether cache_mask holds a 0 (masked slots must then be passed on)
        # per row: (tokens (r,), features (r, F), position of the first) real slots not yet in the drafter cache
        # (chunks of tokens (r,), chunks of features (r, F), position of the first): concatenated once per drafting
        # round, not per step (a long prompt's features, held through skipped rounds, would be copied every step)
        self._pending: list[tuple[list[torch.LongTensor], list[torch.Tensor], int] | None] = [
            None
        ] * self.batch_size
        self._speculative_slots = 0  # slots after the real ones in the cache (dropped next round)
        self._last_num_drafts = 0
        self._skip_left = 0  # plain steps to take before the drafter runs again (cost rule)
        self._skip_len = 1  # the next skip's length (grows by one while drafting keeps losing)
        self._returned_at: float | None = None  # when the last candidates went to verification
        self._round: dict[str, Any] | None = None  # prediction of the round under verification
        self._pays: float | None = None  # running ratio of drafting's realised rate to a plain step's
        self._context = 0  # the target's context (tokens per row, padding included) at this round
        self._verify_context = 0  # ... at the pass under verification
        self._since_plain = 0  # target passes since the last plain step (cost rule's probes)
        self._confidences: list[
            list[float]
        ] = []  # [depth][row] the head's confidence in the last round's drafts
        self._correction = AcceptanceCorrection()  # the calibration as this generation's rounds bear it out
        self._lookup = LookupEstimate()  # prompt-lookup tokens' acceptance as this generation bears it out
        self._trees: list[DraftTree] | None = None  # the trees under verification
        self._start = _clock()
        k = self.num_speculative_tokens
        self.stats = PEagleGenerationStats(
            drafting_mode=self.drafting_mode,
            num_speculative_tokens=k,
            accepted_per_depth=[0] * k,
            drafted_per_depth=[0] * k,
            confidence_threshold=self.confidence_threshold,
            draft_policy=self.policy,
            chosen_k_histogram=[0] * (k + 1),
            batch_size=self.batch_size,
            draft_tree_size=self.tree_nodes,
            tree_size_histogram=[0] * (self.tree_nodes + 1) if self.tree_nodes else [],
        )
        head.last_generation_stats = self.stats

    # ------------------------------------------------------------------ rows and slots
    @property
    def rows(self) -> int:
        """Rows still decoding."""
        return len(self._pending)

    def add_real_slots(self, row: int, tokens: torch.LongTensor, features: torch.Tensor, start: int) -> None:
        """Queue row `row`'s new real slots: `tokens (r,)` (x_{t+1}), `features (r, 3 * H_t)` (f_t), for the
        positions `start..start + r - 1`, right after the slots queued or cached before."""
        tokens, features = tokens.to(self.device), features.to(self.device)
        held = self._pending[row]
        if held is None:
            self._pending[row] = ([tokens], [features], int(start))
        else:
            held[0].append(tokens)
            held[1].append(features)

    def rows_to_keep(self, live: int, most: int) -> int:
        """How many rows the batch should keep when `live` rows still decode and up to `most` could stay (the
        others idle): the count whose plain step the cost model measures cheapest (ties: fewer), timed once per
        machine and count; `live` without the cost rule's measured curves."""
        if self.cost is None or not self.cost.refined_online or most <= live:
            return live
        spent, seconds = 0.0, {}
        for count in range(live, most + 1):
            value, took = ensure_row_seconds(self.cost, self.target, count)
            spent += took
            if value is None:
                return live
            seconds[count] = value
        best = min(seconds, key=lambda c: (seconds[c], c))
        self.stats.cost_timing_seconds += spent
        if self._returned_at is not None:  # the timing is not part of the pass being timed
            self._returned_at += spent
        return best

    def set_idle(self, idle: list[bool]) -> None:
        """Which rows of the batch are ended rows kept idle (their drafts count for nothing in the rule)."""
        self.idle = {b for b, flag in enumerate(idle) if flag}

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keep only the rows `keep` (indices into the current rows; finished rows leave the batch)."""
        keep_list = keep.tolist()
        self._pending = [self._pending[i] for i in keep_list]
        index = keep.to(self.device)
        self.cache.batch_select_indices(index)
        self.cache_mask = self.cache_mask[index]

    def _ragged_block(
        self,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor, torch.LongTensor | None]:
        """The queued real slots of every row as one block, each row right-aligned (left-padded with holes):
        `(tokens (B, R), features (B, R, F), start (B,), mask (B, R) | None)`; start is the position of the
        block's first column in each row (padding columns get positions before the row's first real slot)."""
        assert all(p is not None for p in self._pending), "every row needs its new real slots before a round"
        pending = [(_joined(t), _joined(f), start) for t, f, start in self._pending]
        lengths = [p[0].shape[0] for p in pending]
        width = max(lengths)
        if all(n == width for n in lengths):
            tokens = torch.stack([p[0] for p in pending])
            feats = torch.stack([p[1] for p in pending])
            starts = torch.tensor([p[2] for p in pending], device=self.device)
            return tokens, feats, starts, None
        first = pending[0]
        tokens = first[0].new_full((self.rows, width), self.head.config.mask_token_id)
        feats = first[1].new_zeros(self.rows, width, first[1].shape[-1])
        mask = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        starts = []
        for b, (ids, f, start) in enumerate(pending):
            n = ids.shape[0]
            tokens[b, width - n :] = ids
            feats[b, width - n :] = f
            mask[b, width - n :] = 1
            starts.append(start - (width - n))
        return tokens, feats, torch.tensor(starts, device=self.device), mask

    def _windowed(
        self,
        tokens: torch.LongTensor,
        feats: torch.Tensor,
        starts: torch.LongTensor,
        block_mask: torch.LongTensor | None,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor, torch.LongTensor | None]:
        """The round's block and the drafter's cache cut to the window: at most the last W new real slots
        (a long prompt's older ones are never drafted from), and the cached slots before them dropped so the
        first new slot sees W slots in all."""
        window = self.window
        cut = tokens.shape[1] - window
        if cut > 0:
            tokens, feats, starts = tokens[:, cut:], feats[:, cut:], starts + cut
            block_mask = None if block_mask is None else block_mask[:, cut:]
        held = self.cache_mask.shape[1]
        drop = held - max(0, window - tokens.shape[1])
        if drop > 0:
            drop_oldest(self.cache, drop)
            self.cache_mask = self.cache_mask[:, drop:]
        return tokens, feats, starts, block_mask

    # ------------------------------------------------------------------ token selection
    def _selector(
        self, histories: list[torch.LongTensor], confidences: list[list[float]], rows: list[int] | None
    ):
        """The round's `select(logits, depth)` for [`PEagleDrafter.draft_round`].

        Each depth's `(B, V_draft)` logits become target-vocabulary scores (`-inf` outside the draft vocabulary),
        pass through the call's logits processors with each row's history plus its drafts so far, and give one
        token per row (argmax, or a sample when `do_sample`).  The scores returned are exactly those the token was
        drawn from, as the accept/resample rule requires.  Nothing is proposed when the processors leave some row
        no admissible token (e.g. a forced token outside the draft vocabulary).  The head's probability of each
        draft goes to `confidences[depth][row]`.  A round stops early with a confidence threshold (once every
        row's latest draft is below it: transformers' rule per row) and, under the cost rule, for autoregressive
        heads once one more drafter pass no longer pays.
        """
        contexts = list(histories)
        if self.fast_greedy:  # greedy without processors: no target-vocabulary scores needed (see __init__)

            def select_greedy(logits: torch.Tensor, depth: int):
                prob, index = logits.softmax(dim=-1).max(dim=-1)
                confidences.append(prob.tolist())
                return self.head.draft_to_target(index), None, self._stop(confidences)

            return select_greedy

        def select(logits: torch.Tensor, depth: int):
            scores = self.head.draft_logits_to_target(logits)
            if len(self.logits_processor) > 0:
                scores = grouped_processing(self.logits_processor, contexts, scores, rows, self.batch_size)
                if not bool(torch.isfinite(scores).any(dim=-1).all()):
                    return None
            if self.do_sample:
                token = torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0]
            else:
                token = scores.argmax(dim=-1)
            prob = scores.softmax(dim=-1).gather(-1, token[:, None])[:, 0]
            confidences.append(prob.tolist())
            if len(self.logits_processor) > 0:
                for b in range(len(contexts)):
                    contexts[b] = torch.cat(
                        [contexts[b], token[b : b + 1, None].to(contexts[b].device)], dim=-1
                    )
            return token, scores, self._stop(confidences)

        return select

    def _stop(self, confidences: list[list[float]]) -> bool:
        """Whether the round ends after the drafts just picked (every row past its confidence cut, or the cost
        rule's unroll stop)."""
        if self.policy == "threshold":
            return all(
                any(c < self.confidence_threshold for c in column)
                for column in zip(*confidences, strict=True)
            )
        if self.policy == "cost" and self.drafting_mode == "autoregressive":
            return not self._one_more_pass_pays(confidences)
        return False

    def _calibrated(self, confidences: list[list[float]]) -> list[list[float]]:
        """Per row, the head's calibrated acceptance probabilities of its drafts, before this generation's
        correction (what the correction learns from).  `confidences[depth][row]`."""
        return [calibrated_probabilities(self.calibration, list(c)) for c in zip(*confidences, strict=True)]

    def _row_probabilities(self, confidences: list[list[float]]) -> list[list[float]]:
        """Per row, the acceptance probabilities of its drafts: the head's calibration, corrected by the rounds
        this generation verified so far."""
        return [self._correction.apply(row) for row in self._calibrated(confidences)]

    def _one_more_pass_pays(self, confidences: list[list[float]]) -> bool:
        """Autoregressive heads under the cost rule: whether drafting one more token can raise the expected rate,
        assuming each row's next draft is as likely to be accepted as its last one."""
        rows = self._row_probabilities(confidences)
        depth = len(confidences)
        curve = self.cost.curve(depth + 2, self._context)
        spent = self.cost.drafter_cost(self.cache_mask.shape[1]) + self.cost.drafter_step_seconds * (
            depth - 1
        )
        # one more pass only raises the best rate if the rule would verify the extra draft as well
        more = best_batch_rate([r + r[-1:] for r in rows], curve, spent + self.cost.drafter_step_seconds)
        return more > best_batch_rate(rows, curve, spent)

    # ------------------------------------------------------------------ one round
    def _observe_verify(self, now: float) -> None:
        """Cost rule: fold the timing of the target pass that just ran (a verify pass or a plain step) into the
        cost model, and the round's predicted and measured seconds into the stats (per context bucket)."""
        if self._returned_at is None:
            return
        seconds = now - self._returned_at
        n, context, r = self._last_num_drafts + 1, self._verify_context, self._round
        predicted = self.cost.cost(n, context) if r is None else r["rate_seconds"]
        measured = seconds if r is None else seconds + r["drafter_seconds"]
        self.cost.observe_verify(n, seconds, context)
        if r is not None:
            self.stats.predicted_seconds += r["seconds"]
            self.stats.measured_seconds += measured
            self._round = None
        self.stats.observe_pass(context, self.batch_size, predicted, measured)

    def _returned(self) -> None:
        """Candidates go to verification now (cost rule: the pass is timed from here)."""
        self._since_plain += 1
        if self.policy == "cost":
            self._verify_context = self._context
            self._returned_at = _clock()

    def _plain_step(self) -> DraftCandidates:
        self._last_num_drafts = 0
        self._since_plain = 0
        self._round = None
        self._verify_context = self._context
        self._returned_at = _clock() if self.policy == "cost" else None
        return DraftCandidates.chain(torch.zeros(self.rows, 0, dtype=torch.long, device=self.device))

    def _pending_slots(self) -> int:
        return max((sum(t.shape[0] for t in p[0]) for p in self._pending if p is not None), default=0)

    def _start_from_memory(self, remaining: int) -> bool:
        """Before a call's first drafting round (cost rule): where drafting did not pay at this context in an
        earlier call, skip the drafter for the whole call unless its catch-up over the prompt costs less than
        `PAYS_MARGIN` of the plain steps left (drafting that did not pay is not expected to win more back; a long
        answer can still afford to look again); when it runs, the running estimate starts from that call's.
        Returns whether this step skips the drafter."""
        remembered = self.cost.remembered_pays(self._context)
        if remembered is None or remembered >= 1.0 + PAYS_MARGIN:
            return False
        catch_up = self._pending_slots() * self.cost.drafter_slot_seconds
        if catch_up > PAYS_MARGIN * remaining * self.cost.cost(1, self._context):
            self._skip_left = remaining + 1  # the rest of the call
            return True
        self._pays = remembered  # this round drafts: it is the new prompt's first evidence
        return False

    def _probe_due(self) -> bool:
        """Whether this pass should be a plain step to measure one (cost rule, measured curves only)."""
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

    def finish(self) -> None:
        """The call ended: the cost curve's online figures go to its cache file, and whether drafting paid at
        this context is remembered for the next call."""
        if self.cost is not None:
            if self._pays is not None:
                self.cost.remember_pays(self._context, self._pays)
            persist_cost_model(self.cost)

    def _choose(
        self,
        gains: list[list[float]],
        chains: list[list[float]],
        drafter_seconds: float,
        steps: int,
        histogram: list[int],
        chain_nodes: Any = None,
    ) -> int:
        """Cost rule: how many drafts (chain) or nodes (tree) every row verifies, and whether the next rounds skip
        the drafter.  `gains[row]`: the expected tokens each further draft adds ([`rule.choose_batch_tree_size`]);
        `chains[row]`: the uncorrected calibrated probabilities along the head's chain, of which
        `chain_nodes(n)` (default: n) are verified at size n."""
        drafter_context = self.cache_mask.shape[1]
        self.cost.observe_drafter(drafter_seconds, steps, drafter_context)
        width = min(len(g) for g in gains)
        curve = self.cost.curve(width + 1, self._context)  # the costs at this round's context and batch size
        drafter = self.cost.drafter_cost(drafter_context)
        live = [b for b in range(len(gains)) if b not in self.idle]  # idle rows' tokens count for nothing
        n = choose_batch_tree_size([gains[b] for b in live], curve, drafter)
        row_tokens = [1.0 + sum(g[:n]) for g in gains]
        histogram[n] += 1
        if n == 0:  # declined: the drafter's time spent for nothing, against a plain step's
            self._round = None
            self._fold_pays(curve[0] / (curve[0] + drafter_seconds))
            return n
        verified = chain_nodes(n) if chain_nodes is not None else [n] * len(chains)
        self._round = {
            "calibrated": [c[:m] for c, m in zip(chains, verified)],  # the correction learns from these
            "row_tokens": row_tokens,
            "seconds": curve[n] + drafter_seconds,
            "drafter_seconds": drafter_seconds,
            "rate_seconds": curve[n] + drafter,  # the round's modelled seconds, for whether drafting pays
            "plain_seconds": curve[0],
        }
        return n

    # ------------------------------------------------------------------ trees
    def _grow_trees(
        self, draft: Any, confidences: list[list[float]], histories: list[torch.LongTensor], max_drafts: int
    ) -> list[DraftTree]:
        """One tree per row from the round's per-depth candidates plus its prompt-lookup branch."""
        trees = []
        per_row = parallel_candidates(draft, confidences, self.head, self.calibration, self._correction)
        for b, cands in enumerate(per_row):
            lookup = self._lookup_branch(histories[b], max_drafts)
            trees.append(
                grow_tree(
                    cands,
                    self.tree_nodes,
                    lookup,
                    self._lookup.probabilities(len(lookup)),
                    chain_parents_only=self.drafting_mode == "autoregressive",
                )
            )
        return trees

    def _expand_tree(
        self,
        tokens: torch.LongTensor,
        feats: torch.Tensor,
        starts: torch.LongTensor,
        mask: torch.Tensor | None,
        new_mask: torch.Tensor,
        histories: list[torch.LongTensor],
        depth_limit: int,
        tic: float,
    ) -> DraftCandidates:
        """An autoregressive head's round with trees: EAGLE-2's level-by-level expansion
        ([`tree_drafting.expand_autoregressive_tree`]), then each row's tree picked best-first from its
        candidates plus its prompt-lookup branch."""
        real = torch.cat([self.cache_mask, new_mask], dim=1)
        pays = self._one_more_pass_pays if self.policy == "cost" else None
        pools, confidences, passes, speculative = expand_autoregressive_tree(
            self.head, self.cache, real, tokens, feats, starts, mask, depth_limit, self.calibration,
            self._correction, pays,
        )  # fmt: skip
        self._speculative_slots = speculative
        self.cache_mask = torch.cat([real, real.new_ones(self.rows, speculative)], dim=1)
        self.stats.drafter_forward_calls += passes
        drafter_seconds = _clock() - tic
        self.stats.drafter_seconds += drafter_seconds
        if self.policy == "cost" and tokens.shape[1] >= CATCH_UP_SLOTS:
            self.cost.observe_catch_up(drafter_seconds, tokens.shape[1])
        self._confidences = confidences
        trees = []
        for b, pool in enumerate(pools):
            lookup = self._lookup_branch(histories[b][0], depth_limit)
            trees.append(
                grow_tree_from_pool(
                    pool.tokens,
                    pool.parents,
                    pool.probs,
                    pool.chain,
                    self.tree_nodes,
                    lookup,
                    self._lookup.probabilities(len(lookup)),
                )  # fmt: skip
            )
        return self._tree_candidates(trees, confidences, drafter_seconds, passes)

    def _lookup_branch(self, history: torch.LongTensor, max_drafts: int) -> list[int]:
        return prompt_lookup(history, min(self.lookup_tokens, max_drafts)) if self.lookup_tokens else []

    def _size_trees(
        self,
        trees: list[DraftTree],
        confidences: list[list[float]],
        drafter_seconds: float,
        steps: int,
    ) -> int:
        """How many nodes every row's tree verifies: the cost rule's choice, the full budget (no threshold), or
        the nodes whose path probability reaches the confidence threshold in some row."""
        if self.policy == "cost":
            return self._choose(
                [t.gains() for t in trees],
                self._calibrated(confidences),
                drafter_seconds,
                steps,
                self.stats.tree_size_histogram,
                chain_nodes=lambda n: [sum(t.chain[:n]) for t in trees],
            )
        if self.policy == "threshold":
            n = max(sum(v >= self.confidence_threshold for v in t.values) for t in trees)
        else:
            n = self.tree_nodes
        self.stats.tree_size_histogram[n] += 1
        return n

    def disable_trees(self) -> None:
        """Verify chains from now on (the target cannot verify trees; the loop says why when trees were asked
        for)."""
        self.tree_nodes = self.lookup_tokens = self.stats.draft_tree_size = 0
        self.stats.tree_size_histogram = []

    @torch.no_grad()
    def get_candidates(
        self,
        histories: list[torch.LongTensor],
        max_drafts: int,
        is_first_iteration: bool = False,
        rows: list[int] | None = None,
    ) -> DraftCandidates:
        """Draft up to `max_drafts` (<= K) tokens after each row's history.

        Args:
            histories: per row, `(1, L_b)` the tokens plain `generate()` would show the logits processors (the
                left-padded prompt and the row's tokens so far).
            max_drafts: the most drafts the longest-running row can still use before `max_length`.
            is_first_iteration: the prefill runs next (nothing to draft from yet).
            rows: each row's index in the call's original batch (rows leave the batch when they end); default
                0..B-1.

        Returns:
            [`DraftCandidates`]: a chain of k drafts or a tree of k nodes per row, the same k for every row; k = 0
            on the first call, at the length limit and, under the cost rule, in rounds where verifying drafts is
            not expected to pay.  A sampled chain carries the processed target-vocabulary scores each draft was
            drawn from.
        """
        tic = _clock()
        k = min(self.num_speculative_tokens, max_drafts)
        if is_first_iteration:
            out = self._plain_step()
            self._returned_at = None  # the prefill runs next: not a verify pass to learn from
            return out
        if self.policy == "cost":
            self._observe_verify(tic)
            self._context = max(h.shape[1] for h in histories)
            spent = extend_to_context(
                self.cost,
                self.target,
                self.head,
                self._context,
                len(self.cost.verify_seconds),
                self.batch_size,
            )
            if spent:  # a longer context's costs were timed first (once per machine and context)
                self.stats.cost_timing_seconds += spent
                tic = _clock()
        if k < 1:
            return self._plain_step()
        if self.policy == "cost" and self._skip_left > 0:
            self._skip_left -= 1
            self.stats.skipped_drafter_rounds += 1
            return self._plain_step()
        if self.policy == "cost" and self._probe_due():
            self.stats.probe_steps += 1
            return self._plain_step()
        if self.policy == "cost" and self._pays is None and self._start_from_memory(max_drafts):
            self.stats.skipped_drafter_rounds += 1
            return self._plain_step()

        if self._speculative_slots:  # drop last round's speculative slots
            self.cache.crop(-self._speculative_slots)
            self.cache_mask = self.cache_mask[:, : -self._speculative_slots]
            self._speculative_slots = 0
        if self.has_holes and worth_compacting(self.cache_mask):
            self.cache_mask = compact(self.cache, self.cache_mask)
        tokens, feats, starts, block_mask = self._ragged_block()
        self._pending = [None] * self.rows
        if self.window is not None:
            tokens, feats, starts, block_mask = self._windowed(tokens, feats, starts, block_mask)
        if block_mask is not None:
            self.has_holes = True
        new_mask = block_mask if block_mask is not None else torch.ones_like(tokens)
        mask = torch.cat([self.cache_mask, new_mask], dim=1) if self.has_holes else None
        start: int | torch.Tensor = int(starts[0]) if self.rows == 1 else starts
        if self.tree_nodes and self.drafting_mode == "autoregressive":
            return self._expand_tree(tokens, feats, starts, mask, new_mask, histories, k, tic)
        confidences: list[list[float]] = []
        draft = self.head.draft_round(
            tokens,
            feats,
            k,
            self.cache,
            start,
            select=self._selector([h.to(self.device) for h in histories], confidences, rows),
            attention_mask=mask,
        )
        self._speculative_slots = draft.speculative_slots
        self.cache_mask = torch.cat(
            [self.cache_mask, new_mask, new_mask.new_ones(self.rows, draft.speculative_slots)], dim=1
        )
        self.stats.drafter_forward_calls += draft.forward_calls
        drafts, scores = draft.tokens, draft.scores
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        drafter_seconds = _clock() - tic
        self.stats.drafter_seconds += drafter_seconds
        if self.policy == "cost" and tokens.shape[1] >= CATCH_UP_SLOTS:
            self.cost.observe_catch_up(drafter_seconds, tokens.shape[1])
        self._confidences = confidences
        if self.tree_nodes and drafts.shape[1] > 0:
            trees = self._grow_trees(draft, confidences, [h[0] for h in histories], max_drafts)
            return self._tree_candidates(trees, confidences, drafter_seconds, draft.forward_calls)
        if self.policy == "cost" and drafts.shape[1] > 0:
            calibrated = self._calibrated(confidences)
            keep = self._choose(
                [chain_gains(self._correction.apply(row)) for row in calibrated],
                calibrated,
                drafter_seconds,
                draft.forward_calls - 1,
                self.stats.chosen_k_histogram,
            )
            drafts = drafts[:, :keep]
            scores = scores[:, :keep] if scores is not None else None
            if keep == 0:
                self.stats.declined_rounds += 1

        num = drafts.shape[1]
        if num == 0:
            return self._plain_step()
        self._last_num_drafts = num
        self.stats.draft_tokens += num * self.rows
        if num < k:
            self.stats.truncated_rounds += self.rows
        for d in range(num):
            self.stats.drafted_per_depth[d] += self.rows
        self._returned()
        return DraftCandidates.chain(drafts, scores)

    def _tree_candidates(
        self, trees: list[DraftTree], confidences: list[list[float]], drafter_seconds: float, passes: int
    ) -> DraftCandidates:
        """The round's trees, all of one size (padded), or a plain step when the rule verifies no node."""
        n = self._size_trees(trees, confidences, drafter_seconds, passes - 1)
        if n == 0:
            if self.policy == "cost":
                self.stats.declined_rounds += 1
            return self._plain_step()
        trees = [t.truncated(n) for t in trees]
        self._trees = trees
        self._last_num_drafts = n
        self.stats.draft_tokens += n * self.rows
        self.stats.tree_rounds += self.rows
        for t in trees:
            for d in sorted({d for d, p in zip(t.depths, t.parents) if p != -2}):
                _bump(self.stats.drafted_per_depth, d - 1)
        self._returned()
        return DraftCandidates.of_trees(trees, self.device)

    def update_candidate_strategy(
        self, accepted: list[int], live: list[bool] | None = None, paths: list[list[int]] | None = None
    ) -> None:
        """Record the round just verified: per row, the drafts kept (after EOS and `max_length` cut the row); each
        row also emitted one token of the target's own.  `paths`: the slots of each row's accepted path (root
        first).  Rows marked not `live` (ended rows kept idle in the batch) count nowhere."""
        stats = self.stats
        trees, self._trees = self._trees, None
        counted = [b for b in range(len(accepted)) if live is None or live[b]]
        accepted_all, accepted = accepted, [accepted[b] for b in counted]
        rows = len(accepted)
        if self._last_num_drafts > 0:
            recorder = getattr(self.head, "round_recorder", None)
            for b in counted:
                matches = accepted_all[b]
                chain_matches = matches
                if trees is not None:  # the chain's and the lookup branch's share of the accepted path
                    nodes = [slot - 1 for slot in paths[b][1 : matches + 1]]
                    chain_matches = _leading(trees[b].chain, nodes)
                    on_branch = sum(trees[b].lookup)
                    if on_branch:
                        hit = _leading(trees[b].lookup, nodes)
                        self._lookup.observe(min(on_branch, hit + 1), hit)
                elif recorder is not None:  # calibration runs collect (confidences, accepted) per round
                    column = [depth[b] for depth in self._confidences[: self._last_num_drafts]]
                    recorder.append((column, matches))
                for d in range(matches):
                    _bump(stats.accepted_per_depth, d)
                if self._round is not None:
                    self._correction.observe(self._round["calibrated"][b], chain_matches)
            stats.rounds += rows
            stats.accepted_tokens += sum(accepted)
            if self._round is not None and rows:
                stats.predicted_tokens += sum(self._round["row_tokens"][b] for b in counted)
                stats.realised_tokens += sum(accepted) + rows
                # does drafting pay? the tokens this round realised per row, at its modelled seconds, against a
                # plain step's one token (the calibration's promise does not count here, the outcome does)
                r = self._round
                self._fold_pays((sum(accepted) + rows) / rows / r["rate_seconds"] * r["plain_seconds"])
        else:
            stats.plain_steps += rows
        stats.target_batch_passes += 1
        stats.generated_tokens += sum(accepted) + rows
        stats.total_seconds = _clock() - self._start


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


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


__all__ = [
    "PEagleCandidateGenerator",
    "grouped_processing",
    "resolve_num_speculative_tokens",
    "resolve_confidence_threshold",
    "resolve_tree_settings",
]
