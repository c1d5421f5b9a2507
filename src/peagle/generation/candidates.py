"""The candidate generator transformers' assisted decoding calls once per round with a P-EAGLE head.

After a verify pass the sequence is x_0..x_{n-1}; the target features f_0..f_{n-2} are known and x_{n-1} is the
bonus token.  The drafter's KV cache holds the real slots 0..c-1 from earlier rounds followed by the previous
round's speculative slots.  Each round crops the speculative slots away (rejected drafts were only ever
speculative slots), then runs [`PEagleDrafter.draft_round`] on the new real slots c..n-2 (slot t =
embed(x_{t+1}) + fc(f_t) at position t: the accepted drafts and the bonus, paired with the verify pass's
features).  docs/DESIGN.md section 3 has the slot layout.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.utils import ModelOutput, logging

from ..configuration_peagle import default_aux_layer_ids
from ..modeling_peagle import PEagleDrafter
from .cost import (
    AcceptanceCorrection,
    best_rate,
    calibrated_probabilities,
    choose_num_drafts,
    cost_model_for,
    expected_tokens,
)
from .stats import PEagleGenerationStats

logger = logging.get_logger(__name__)

PAYS_SMOOTHING = 0.2
"""Weight of the newest drafting round in the running estimate of whether drafting pays (cost rule)."""
MAX_SKIP = 8
"""Most plain steps in a row without running the drafter (cost rule); each losing probe adds one."""


def text_config(model_or_config: Any) -> Any:
    """The text config of a model or config (multimodal configs nest it)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _given(generation_config: GenerationConfig, name: str) -> Any:
    """`generation_config.<name>` when the user set it, else None.

    transformers fills unset values with its global defaults before the candidate generator is built; peagle's
    hook records which names the user passed to `generate()` (`_peagle_given`), so a value equal to the default
    (e.g. `num_assistant_tokens=20`) still counts as given.  Without that record (a `GenerationConfig` passed
    whole), a value equal to transformers' default reads as "not given"."""
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
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_assistant_tokens (K) is {k!r}; expected an integer >= 1.")
    return k


def resolve_confidence_threshold(
    generation_config: GenerationConfig, head: PEagleDrafter | None = None
) -> float | None:
    """The draft-confidence cut for one `generate()` call, or None for cost-aware drafting.

    `assistant_confidence_threshold` when given, else the head's `config.confidence_threshold`; None when neither
    is set (a head's default), which selects the cost-aware rule (docs/DESIGN.md section 7).  Without a head:
    0.0.  With a threshold `t > 0`, a round keeps its drafts up to and including the first one whose probability
    under the head is below `t` (the rule of transformers' `ConfidenceCriteria` for draft models); 0.0 drafts all
    K tokens every round, as vLLM does.  The output is unchanged either way (greedy: identical; sampling: same
    distribution), only the work per round changes.  transformers fills an unset threshold with its global
    default (0.4); an explicit 0.4 passed to `generate()` still counts as given.
    """
    value = _given(generation_config, "assistant_confidence_threshold")
    if value is None:
        if head is None:
            return 0.0
        own = head.config.confidence_threshold
        return None if own is None else float(own)
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"assistant_confidence_threshold is {value!r}; expected a probability in [0, 1].")
    return value


# ---------------------------------------------------------------------------------------------- generator
_ATTACHED_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PEagleCandidateGenerator(CandidateGenerator):
    """Candidate generator drafting K tokens per round with a [`PEagleDrafter`].

    Built by transformers' generation dispatch (through the hook `import peagle` installs) when
    `assistant_model` is a P-EAGLE head.  The verify forward of the target is asked for the hidden states of
    `config.eagle_aux_hidden_state_layer_ids` (`output_hidden_states[i]`, index 0 = embeddings) through
    `model_kwargs_overrides`; `get_candidates` turns them into the drafter's new real slots.

    Args:
        target: the target model running `generate()`.
        head: the drafter.
        generation_config: the call's generation config (K, sampling, `max_length`).
        logits_processor: the processors transformers applies to the target's logits; applied to the draft
            logits too (temperature, top-k, top-p, penalties), so drafts follow the same rules.
    """

    requires_model_outputs: bool = True

    def __init__(
        self,
        target: Any,
        head: PEagleDrafter,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
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
        self.cost = (
            cost_model_for(target, head, self.num_speculative_tokens + 1) if self.policy == "cost" else None
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
        # come straight from the draft vocabulary and no target-vocabulary logits go back to transformers
        self.fast_greedy = (
            not self.do_sample
            and len(self.logits_processor) == 0
            and getattr(generation_config, "assistant_ensemble_weight", None) is None
        )
        self.max_length = generation_config.max_length
        self.device = head.device
        if cfg.embed_from_target:
            weight = target.get_input_embeddings().weight
            ref = _ATTACHED_EMBEDDINGS.get(head)
            if head.embed_tokens.weight is not weight and (ref is None or ref() is not weight):
                head.attach_target(target)
                _ATTACHED_EMBEDDINGS[head] = weakref.ref(weight)

        self.cache = DynamicCache(config=cfg)
        self._next_real = 0  # position of the first real slot not yet in the drafter cache
        self._speculative_slots = 0  # slots after the real ones in the cache (dropped next round)
        self._prev_len: int | None = None  # length of the sequence the last verify pass ran up to
        self._last_num_drafts = 0
        self._pending: tuple[torch.LongTensor, torch.Tensor] | None = None  # real slots a skipped round left
        self._skip_left = 0  # plain steps to take before the drafter runs again (cost rule)
        self._skip_len = 1  # the next skip's length (grows by one while drafting keeps losing)
        self._returned_at: float | None = None  # when the last candidates went to verification
        self._round: dict[str, Any] | None = None  # prediction of the round under verification
        self._pays: float | None = None  # running ratio of drafting's expected rate to a plain step's
        self._confidences: list[float] = []  # the head's confidence in each draft of the last round
        self._correction = AcceptanceCorrection()  # the calibration as this generation's rounds bear it out
        self._start = time.perf_counter()
        k = self.num_speculative_tokens
        self.stats = PEagleGenerationStats(
            drafting_mode=self.drafting_mode,
            num_speculative_tokens=k,
            accepted_per_depth=[0] * k,
            drafted_per_depth=[0] * k,
            confidence_threshold=self.confidence_threshold,
            draft_policy=self.policy,
            chosen_k_histogram=[0] * (k + 1),
        )
        head.last_generation_stats = self.stats

    # ------------------------------------------------------------------ target features
    def _new_real_slots(
        self, input_ids: torch.LongTensor, model_outputs: ModelOutput
    ) -> tuple[int, torch.LongTensor, torch.Tensor]:
        """The real slots not yet cached: `(start, tokens (1, R), features (1, R, 3 * H_t))` for slots start..n-2."""
        states = getattr(model_outputs, "hidden_states", None)
        if (
            states is None
            or len(states) != self.num_target_layers + 1
            or any(states[i] is None for i in self.aux_layer_ids)
        ):
            got = "none" if states is None else f"{len(states)} entries"
            raise RuntimeError(
                f"the target's verify pass returned hidden states ({got}) without layers {self.aux_layer_ids} "
                f"in a tuple of {self.num_target_layers + 1} (embeddings + one per layer); transformers "
                f"{transformers.__version__} handles `output_hidden_states` differently from what peagle expects."
            )
        n = input_ids.shape[1]
        verified = states[self.aux_layer_ids[0]].shape[1]
        verify_start = self._prev_len - verified  # sequence position of the verify pass's first input
        start = max(self._next_real, verify_start)
        lo, hi = start - verify_start, n - 1 - verify_start
        feats = torch.cat([states[i][:, lo:hi] for i in self.aux_layer_ids], dim=-1)
        tokens = input_ids[:, start + 1 : n]
        return start, tokens.to(self.device), feats.to(self.device)

    # ------------------------------------------------------------------ token selection
    def _selector(self, context: torch.LongTensor, confidences: list[float]):
        """The round's `select(logits, depth)` for [`PEagleDrafter.draft_round`].

        Each depth's `(1, V_draft)` logits become target-vocabulary scores (`-inf` outside the draft vocabulary),
        pass through the call's logits processors with the drafts so far as context, and give one token (argmax,
        or a sample when `do_sample`).  The scores returned are exactly those the token was drawn from, as
        transformers' accept/resample rule requires.  Nothing is proposed when the processors leave no
        admissible token (e.g. a forced token outside the draft vocabulary).  The head's probability of each
        draft goes to `confidences`.  A round stops early with a confidence threshold (after its first draft the
        head gives a lower probability: transformers' rule) and, under the cost rule, for autoregressive heads
        once one more drafter pass no longer pays.
        """
        state = {"context": context}
        if self.fast_greedy:  # greedy without processors: no target-vocabulary scores needed (see __init__)

            def select_greedy(logits: torch.Tensor, depth: int):
                prob, index = logits.softmax(dim=-1).max(dim=-1)
                confidences.append(float(prob[0]))
                return self.head.draft_to_target(index), None, self._stop(confidences)

            return select_greedy

        def select(logits: torch.Tensor, depth: int):
            scores = self.head.draft_logits_to_target(logits)
            if len(self.logits_processor) > 0:
                scores = self.logits_processor(state["context"], scores.clone())
                if not bool(torch.isfinite(scores).any()):
                    return None
            if self.do_sample:
                token = torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0]
            else:
                token = scores.argmax(dim=-1)
            prob = float(scores.softmax(dim=-1).gather(-1, token[:, None])[0, 0])
            confidences.append(prob)
            if len(self.logits_processor) > 0:
                state["context"] = torch.cat([state["context"], token[:, None].to(context.device)], dim=-1)
            return token, scores, self._stop(confidences)

        return select

    def _stop(self, confidences: list[float]) -> bool:
        """Whether the round ends after the draft just picked (confidence cut, or the cost rule's unroll stop)."""
        if self.policy == "threshold":
            return confidences[-1] < self.confidence_threshold
        if self.policy == "cost" and self.drafting_mode == "autoregressive":
            return not self._one_more_pass_pays(confidences)
        return False

    def _one_more_pass_pays(self, confidences: list[float]) -> bool:
        """Autoregressive heads under the cost rule: whether drafting one more token can raise the expected rate,
        assuming the next draft is as likely to be accepted as the last one."""
        probs = self._probabilities(confidences)
        curve = self.cost.curve(len(probs) + 2)
        spent = self.cost.drafter_seconds + self.cost.drafter_step_seconds * (len(probs) - 1)
        # one more pass only raises the best rate if the rule would verify the extra draft as well
        more = best_rate(probs + probs[-1:], curve, spent + self.cost.drafter_step_seconds)
        return more > best_rate(probs, curve, spent)

    def _probabilities(self, confidences: list[float]) -> list[float]:
        """Acceptance probabilities of a round's drafts: the head's calibration, corrected by the rounds this
        generation verified so far."""
        return self._correction.apply(calibrated_probabilities(self.calibration, confidences))

    # ------------------------------------------------------------------ one round
    def _observe_verify(self, now: float) -> None:
        """Cost rule: fold the timing of the verify pass that just ran into the cost model and the stats."""
        if self._returned_at is None:
            return
        seconds = now - self._returned_at
        self.cost.observe_verify(self._last_num_drafts + 1, seconds)
        if self._round is not None:
            self.stats.predicted_seconds += self._round["seconds"]
            self.stats.measured_seconds += self._round["drafter_seconds"] + seconds
            self._round = None

    def _plain_step(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, None]:
        self._last_num_drafts = 0
        self._prev_len = input_ids.shape[1]
        self._returned_at = time.perf_counter() if self.policy == "cost" else None
        return input_ids, None

    def _choose(self, confidences: list[float], drafter_seconds: float, steps: int) -> int:
        """Cost rule: how many of the round's drafts to verify (and whether the next rounds skip the drafter)."""
        self.cost.observe_drafter(drafter_seconds, steps)
        calibrated = calibrated_probabilities(self.calibration, confidences)
        probs = self._correction.apply(calibrated)
        curve = self.cost.curve(len(probs) + 1)
        k = choose_num_drafts(probs, curve, self.cost.drafter_seconds)
        predicted = expected_tokens(probs, k)
        self.stats.chosen_k_histogram[k] += 1
        self._round = {
            "calibrated": calibrated[:k],  # what the correction learns from: the uncorrected prediction
            "tokens": predicted,
            "seconds": curve[k] + drafter_seconds,
            "drafter_seconds": drafter_seconds,
        }
        # does drafting pay at all? compare the round's expected rate (drafter included) with a plain step's
        ratio = (predicted / (curve[k] + self.cost.drafter_seconds)) * curve[0]
        self._pays = (
            ratio if self._pays is None else (1 - PAYS_SMOOTHING) * self._pays + PAYS_SMOOTHING * ratio
        )
        if self._pays < 1.0:  # drafting is expected to lose: skip the drafter, longer while it keeps losing
            self._skip_left, self._skip_len = self._skip_len, min(self._skip_len + 1, MAX_SKIP)
        else:
            self._skip_len = 1
        return k

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: ModelOutput | None = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft up to K tokens after `input_ids` `(1, n)`.

        Returns `(candidate_ids (1, n + k), draft_logits (1, k, vocab_size) | None)`; `k = 0` on the first call
        (the target's prefill must run first to provide features), at the length limit, and, under the cost
        rule, in rounds where verifying drafts is not expected to pay.
        """
        tic = time.perf_counter()
        n = input_ids.shape[1]
        k = min(self.num_speculative_tokens, self.max_length - n - 1)
        if is_first_iteration or model_outputs is None:
            out = self._plain_step(input_ids)
            self._returned_at = None  # the prefill runs next: not a verify pass to learn from
            return out
        if self.policy == "cost":
            self._observe_verify(tic)
        if k < 1:
            return self._plain_step(input_ids)

        start, tokens, feats = self._new_real_slots(input_ids, model_outputs)
        if self._pending is not None:  # real slots of skipped rounds: the drafter catches up in this pass
            tokens, feats = torch.cat([self._pending[0], tokens], 1), torch.cat([self._pending[1], feats], 1)
            start = start - self._pending[0].shape[1]
            self._pending = None
        self._next_real = n - 1
        if self.policy == "cost" and self._skip_left > 0:
            self._skip_left -= 1
            self._pending = (tokens, feats)
            self.stats.skipped_drafter_rounds += 1
            return self._plain_step(input_ids)

        self.cache.crop(-self._speculative_slots)  # drop last round's speculative slots
        confidences: list[float] = []
        draft = self.head.draft_round(
            tokens, feats, k, self.cache, start, select=self._selector(input_ids.to(self.device), confidences)
        )
        self._speculative_slots = draft.speculative_slots
        self.stats.drafter_forward_calls += draft.forward_calls
        drafts, logits = draft.tokens, draft.scores
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        drafter_seconds = time.perf_counter() - tic
        self.stats.drafter_seconds += drafter_seconds
        self._confidences = confidences
        if self.policy == "cost" and drafts.shape[1] > 0:
            keep = self._choose(confidences, drafter_seconds, draft.forward_calls - 1)
            drafts = drafts[:, :keep]
            logits = logits[:, :keep] if logits is not None else None
            if keep == 0:
                self.stats.declined_rounds += 1

        num = drafts.shape[1]
        if num == 0:
            return self._plain_step(input_ids)
        self._last_num_drafts = num
        self._prev_len = n + num
        self.stats.draft_tokens += num
        if num < k:
            self.stats.truncated_rounds += 1
        for d in range(num):
            self.stats.drafted_per_depth[d] += 1
        candidates = torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1)
        if self.policy == "cost":
            self._returned_at = time.perf_counter()
        return candidates, logits

    def update_candidate_strategy(
        self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int
    ) -> None:
        """Record the round transformers just verified (K stays fixed)."""
        matches = int(num_matches)
        stats = self.stats
        if self._last_num_drafts > 0:
            recorder = getattr(self.head, "round_recorder", None)
            if recorder is not None:  # calibration runs collect (confidences, accepted) per round
                recorder.append((list(self._confidences[: self._last_num_drafts]), matches))
            stats.rounds += 1
            stats.accepted_tokens += matches
            for d in range(matches):
                stats.accepted_per_depth[d] += 1
            if self._round is not None:
                stats.predicted_tokens += self._round["tokens"]
                stats.realised_tokens += matches + 1
                self._correction.observe(self._round["calibrated"], matches)
        else:
            stats.plain_steps += 1
            self._round = None
        stats.generated_tokens += matches + 1
        stats.total_seconds = time.perf_counter() - self._start


__all__ = [
    "PEagleCandidateGenerator",
    "resolve_num_speculative_tokens",
    "resolve_confidence_threshold",
    "text_config",
]
