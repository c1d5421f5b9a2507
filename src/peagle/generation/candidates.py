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
from .stats import PEagleGenerationStats

logger = logging.get_logger(__name__)


def text_config(model_or_config: Any) -> Any:
    """The text config of a model or config (multimodal configs nest it)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _given(generation_config: GenerationConfig, name: str) -> Any:
    """`generation_config.<name>`, or None when unset or equal to transformers' global default (which
    transformers fills in before the candidate generator is built, so it cannot be told apart from unset)."""
    value = getattr(generation_config, name)
    default = GenerationConfig._get_default_generation_params().get(name)
    return None if value is None or value == default else value


def resolve_num_speculative_tokens(generation_config: GenerationConfig, head: PEagleDrafter) -> int:
    """K for one `generate()` call: `num_assistant_tokens` when given, else `head.config.num_speculative_tokens`.

    transformers fills an unset `num_assistant_tokens` with its global default (20) before the generator is
    built, so that exact value cannot be told apart from "not given" and means the head's default; set
    `head.config.num_speculative_tokens = 20` for K=20.
    """
    requested = _given(generation_config, "num_assistant_tokens")
    k = head.config.num_speculative_tokens if requested is None else requested
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_assistant_tokens (K) is {k!r}; expected an integer >= 1.")
    return k


def resolve_confidence_threshold(
    generation_config: GenerationConfig, head: PEagleDrafter | None = None
) -> float:
    """The draft-confidence cut for one `generate()` call: `assistant_confidence_threshold` when given, else the
    head's default `head.config.confidence_threshold` (0.0 without a head).

    With a threshold `t > 0`, a round keeps its drafts up to and including the first one whose probability
    under the head is below `t` (the rule of transformers' `ConfidenceCriteria` for draft models): fewer
    tokens to verify when the head is unsure, and fewer drafter passes for autoregressive heads.  The output
    is unchanged (greedy: identical; sampling: same distribution), only the work per round changes.
    transformers fills an unset threshold with its global default (0.4); peagle reads that exact value as
    "not given" and uses the head's default; pass 0.0 to draft all K tokens every round, as vLLM does.
    """
    value = _given(generation_config, "assistant_confidence_threshold")
    if value is None:
        return float(head.config.confidence_threshold) if head is not None else 0.0
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
        self.confidence_threshold = resolve_confidence_threshold(generation_config, head)
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
        self._start = time.perf_counter()
        k = self.num_speculative_tokens
        self.stats = PEagleGenerationStats(
            drafting_mode=self.drafting_mode,
            num_speculative_tokens=k,
            accepted_per_depth=[0] * k,
            drafted_per_depth=[0] * k,
            confidence_threshold=self.confidence_threshold,
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
    def _selector(self, context: torch.LongTensor):
        """The round's `select(logits, depth)` for [`PEagleDrafter.draft_round`].

        Each depth's `(1, V_draft)` logits become target-vocabulary scores (`-inf` outside the draft vocabulary),
        pass through the call's logits processors with the drafts so far as context, and give one token (argmax,
        or a sample when `do_sample`).  The scores returned are exactly those the token was drawn from, as
        transformers' accept/resample rule requires.  Nothing is proposed when the processors leave no
        admissible token (e.g. a forced token outside the draft vocabulary); with a confidence threshold the
        round ends after its first draft the head gives a lower probability (transformers' rule).
        """
        state = {"context": context}

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
            stop = False
            if self.confidence_threshold > 0:
                prob = scores.softmax(dim=-1).gather(-1, token[:, None])[:, 0]
                stop = bool(prob[0] < self.confidence_threshold)
            if len(self.logits_processor) > 0:
                state["context"] = torch.cat([state["context"], token[:, None].to(context.device)], dim=-1)
            return token, scores, stop

        return select

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
        (the target's prefill must run first to provide features) and at the length limit.
        """
        n = input_ids.shape[1]
        k = min(self.num_speculative_tokens, self.max_length - n - 1)
        if is_first_iteration or model_outputs is None or k < 1:
            self._prev_len = n
            self._last_num_drafts = 0
            return input_ids, None

        tic = time.perf_counter()
        start, tokens, feats = self._new_real_slots(input_ids, model_outputs)
        self.cache.crop(-self._speculative_slots)  # drop last round's speculative slots
        draft = self.head.draft_round(
            tokens, feats, k, self.cache, start, select=self._selector(input_ids.to(self.device))
        )
        self._speculative_slots = draft.speculative_slots
        self.stats.drafter_forward_calls += draft.forward_calls
        drafts, logits = draft.tokens, draft.scores
        self._next_real = n - 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.drafter_seconds += time.perf_counter() - tic

        num = drafts.shape[1]
        self._last_num_drafts = num
        self._prev_len = n + num
        if num == 0:
            return input_ids, None
        self.stats.draft_tokens += num
        if num < k:
            self.stats.truncated_rounds += 1
        for d in range(num):
            self.stats.drafted_per_depth[d] += 1
        candidates = torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1)
        return candidates, logits

    def update_candidate_strategy(
        self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int
    ) -> None:
        """Record the round transformers just verified (K stays fixed)."""
        matches = int(num_matches)
        stats = self.stats
        if self._last_num_drafts > 0:
            stats.rounds += 1
            stats.accepted_tokens += matches
            for d in range(matches):
                stats.accepted_per_depth[d] += 1
        else:
            stats.plain_steps += 1
        stats.generated_tokens += matches + 1
        stats.total_seconds = time.perf_counter() - self._start


__all__ = [
    "PEagleCandidateGenerator",
    "resolve_num_speculative_tokens",
    "resolve_confidence_threshold",
    "text_config",
]
