"""P-EAGLE drafting inside transformers' `generate()`.

`import peagle` installs one small, version-guarded hook on transformers' generation dispatch, so that

    target.generate(input_ids, assistant_model=head, max_new_tokens=...)

drafts with [`PEagleCandidateGenerator`] whenever `head` is a [`PEagleDrafter`]; every other assistant reaches
transformers untouched.  transformers' own `_assisted_decoding` loop does the verification, so greedy output is
token-for-token the target's own and sampling keeps the target's distribution (accept/resample rule).

One round (DESIGN.md section 3).  After a verify pass the sequence is x_0..x_{n-1}; the target features
f_0..f_{n-2} are known and x_{n-1} is the bonus token.  The drafter's KV cache holds the real slots
0..c-1 from earlier rounds followed by the previous round's K-1 speculative slots.  The round

1. crops the K-1 speculative slots away (rejected drafts were only ever speculative slots),
2. appends the new real slots c..n-2 (slot t = embed(x_{t+1}) + fc(f_t) at position t: the accepted drafts
   and the bonus, paired with the verify pass's features),
3. appends K-1 parallel slots (mask embedding + fc(mask_hidden), positions n-1..n+K-3),

all in ONE drafter forward; the K drafts are read from the last K slots (bonus + parallel).  In
`drafting_mode="autoregressive"` (EAGLE-3 heads) step 1 runs the real slots and each of the K-1 following steps
feeds one slot (token = previous draft, hidden input = previous step's `last_hidden_state`, skipping `fc`).
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import transformers
from packaging import version
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.utils import GenerationMixin
from transformers.utils import ModelOutput, logging

from .configuration_peagle import default_aux_layer_ids
from .modeling_peagle import PEagleDrafter

logger = logging.get_logger(__name__)

MIN_TRANSFORMERS_VERSION = "5.23"
"""Oldest transformers whose list-valued `output_hidden_states` keeps the embeddings at index 0."""

_HOOKED_METHODS = ("_validate_generation_mode", "_get_candidate_generator")
_DISPATCH_PARAMETERS = {
    "generation_config",
    "input_ids",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
}
_VALIDATE_PARAMETERS = ["self", "generation_mode", "generation_config", "generation_mode_kwargs"]


# ---------------------------------------------------------------------------------------------- statistics
@dataclass
class PEagleGenerationStats:
    """What one `generate()` call with a P-EAGLE head did; stored as `head.last_generation_stats`.

    A *round* is a target verify pass that checked at least one draft token.  The target's first token (from
    the prompt prefill, before any features exist) and steps at the length limit are *plain steps*.  Always
    `generated_tokens == accepted_tokens + rounds + plain_steps`, which is the number of new tokens.

    Args:
        drafting_mode: `"parallel"` or `"autoregressive"`.
        num_draft_tokens: K, draft tokens requested per round.
        rounds: verify passes with drafts.
        draft_tokens: draft tokens proposed over all rounds.
        accepted_tokens: draft tokens kept (greedy: matched; sampling: accepted by the accept/resample rule).
        plain_steps: target steps without drafts.
        generated_tokens: new tokens emitted in total.
        accepted_per_depth: `[K]` rounds whose draft at depth d (0 = first draft) was kept.
        drafted_per_depth: `[K]` rounds that proposed a draft at depth d.
        drafter_forward_calls: drafter forward passes (parallel: one per round; autoregressive: K per round).
        confidence_threshold: the `assistant_confidence_threshold` in effect (0.0: every round drafts K tokens).
        truncated_rounds: rounds that drafted fewer tokens than allowed there (K, or fewer near `max_length`):
            cut by the confidence threshold, or a logits processor left no admissible draft.
        drafter_seconds: wall time spent drafting (forwards and token selection).
        total_seconds: wall time from the start of decoding to the last verified round.
    """

    drafting_mode: str = "parallel"
    num_draft_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0
    generated_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    drafted_per_depth: list[int] = field(default_factory=list)
    drafter_forward_calls: int = 0
    confidence_threshold: float = 0.0
    truncated_rounds: int = 0
    drafter_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tau: tokens emitted per round, bonus included (`(accepted + rounds) / rounds`); 0.0 without rounds."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        """Fraction of the rounds drafting depth d whose draft at depth d was kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    def to_dict(self) -> dict[str, Any]:
        """All fields plus `acceptance_length` and `acceptance_rate_per_depth`, JSON-ready."""
        out = asdict(self)
        out["acceptance_length"] = self.acceptance_length
        out["acceptance_rate_per_depth"] = self.acceptance_rate_per_depth
        return out


# ---------------------------------------------------------------------------------------------- checks
def _text_config(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@functools.cache
def _integration_problem() -> str | None:
    """Why this transformers cannot run P-EAGLE drafting, or `None` when its internals are the expected ones."""
    installed = version.parse(transformers.__version__)
    if installed.release < version.parse(MIN_TRANSFORMERS_VERSION).release:
        return (
            f"transformers {transformers.__version__} is older than {MIN_TRANSFORMERS_VERSION}: its list-valued "
            "`output_hidden_states` has no embeddings entry at index 0, so the aux layer ids would be off by one"
        )
    if not hasattr(CandidateGenerator, "requires_model_outputs"):
        return "CandidateGenerator has no `requires_model_outputs` (candidate generators cannot read verify outputs)"
    dispatch = getattr(
        GenerationMixin._get_candidate_generator, "__wrapped__", GenerationMixin._get_candidate_generator
    )
    missing = _DISPATCH_PARAMETERS - set(inspect.signature(dispatch).parameters)
    if missing:
        return f"GenerationMixin._get_candidate_generator lacks the parameters {sorted(missing)}"
    assisted = getattr(GenerationMixin, "_assisted_decoding", None)
    if assisted is None:
        return "GenerationMixin has no `_assisted_decoding`"
    try:
        source = inspect.getsource(assisted)
    except (OSError, TypeError):  # no source shipped: trust the signature checks above
        return None
    for needle in ("model_kwargs_overrides", "n_last_matches", "update_candidate_strategy"):
        if needle not in source:
            return f"GenerationMixin._assisted_decoding no longer uses `{needle}`"
    return None


def _raise_if_incompatible() -> None:
    problem = _integration_problem()
    if problem is not None:
        raise RuntimeError(
            f"peagle cannot draft inside generate() with transformers {transformers.__version__}: {problem}. "
            f"Install transformers>={MIN_TRANSFORMERS_VERSION},<6 (the versions peagle's generation hook was written for)."
        )


def check_generation_request(
    target: Any,
    head: PEagleDrafter,
    generation_config: GenerationConfig,
    batch_size: int | None = None,
    generation_mode: Any = None,
) -> None:
    """Raise a `ValueError` naming what is supported when `target.generate(..., assistant_model=head)` cannot work.

    Supported: a decoder-only target the head was built for (hidden size, vocabulary, layer count), batch size 1,
    `num_beams=1`, `num_return_sequences=1`, greedy search or sampling.
    """
    tc = _text_config(target)
    if getattr(tc, "is_encoder_decoder", False):
        raise ValueError(
            f"P-EAGLE drafting supports decoder-only targets; {type(target).__name__} is encoder-decoder."
        )
    num_beams = generation_config.num_beams or 1
    if num_beams > 1:
        raise ValueError(
            f"P-EAGLE drafting supports greedy search and sampling with num_beams=1; got num_beams={num_beams}."
        )
    num_return = generation_config.num_return_sequences or 1
    if num_return > 1:
        raise ValueError(
            f"P-EAGLE drafting returns one sequence per prompt (num_return_sequences=1); got num_return_sequences={num_return}."
        )
    if generation_mode is not None and generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"P-EAGLE drafting supports greedy search and sampling; these generation options select "
            f"{getattr(generation_mode, 'value', generation_mode)!r} instead."
        )
    conflicting = {
        "prompt_lookup_num_tokens": getattr(generation_config, "prompt_lookup_num_tokens", None),
        "assistant_early_exit": getattr(generation_config, "assistant_early_exit", None),
        "speculation_type": getattr(generation_config, "speculation_type", None),
        "use_mtp": getattr(generation_config, "use_mtp", None) or None,
    }
    conflicting = {k: v for k, v in conflicting.items() if v is not None}
    if conflicting:
        raise ValueError(f"a P-EAGLE assistant_model drafts on its own; unset {conflicting} (expected None).")
    if batch_size is not None and batch_size != 1:
        raise ValueError(
            f"P-EAGLE drafting in generate() supports batch size 1; got a batch of {batch_size} prompts. "
            "Call generate() once per prompt."
        )
    head.check_target(tc)
    expected_layers = head.config.target_num_hidden_layers
    if expected_layers is not None and getattr(tc, "num_hidden_layers", expected_layers) != expected_layers:
        raise ValueError(
            f"head was built for a target with {expected_layers} layers, target has {tc.num_hidden_layers}."
        )


def _given(generation_config: GenerationConfig, name: str) -> Any:
    """`generation_config.<name>`, or None when unset or equal to transformers' global default (which
    transformers fills in before the candidate generator is built, so it cannot be told apart from unset)."""
    value = getattr(generation_config, name)
    default = GenerationConfig._get_default_generation_params().get(name)
    return None if value is None or value == default else value


def resolve_num_draft_tokens(generation_config: GenerationConfig, head: PEagleDrafter) -> int:
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
        tc = _text_config(target)
        self.head = head
        self.drafting_mode = cfg.drafting_mode
        self.num_target_layers = int(tc.num_hidden_layers)
        self.aux_layer_ids = list(
            cfg.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(self.num_target_layers)
        )
        self.num_draft_tokens = resolve_num_draft_tokens(generation_config, head)
        self.confidence_threshold = resolve_confidence_threshold(generation_config, head)
        if self.drafting_mode == "parallel" and self.num_draft_tokens > cfg.num_parallel_positions:
            logger.warning_once(
                f"drafting K={self.num_draft_tokens} tokens per round with a head trained for "
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
        k = self.num_draft_tokens
        self.stats = PEagleGenerationStats(
            drafting_mode=self.drafting_mode,
            num_draft_tokens=k,
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
    def _pick(
        self, context: torch.LongTensor, draft_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pick one draft from `(1, V_draft)` logits; returns `(token (1,), target-vocab logits (1, V))`.

        The returned logits are exactly those the token was drawn from (after the logits processors), with
        `-inf` outside the draft vocabulary, as transformers' accept/resample rule requires.  `None` when the
        processors leave no admissible token (e.g. a forced token outside the draft vocabulary).
        """
        scores = self.head.draft_logits_to_target(draft_logits.float())
        if len(self.logits_processor) > 0:
            scores = self.logits_processor(context, scores.clone())
            if not bool(torch.isfinite(scores).any()):
                return None
        if self.do_sample:
            token = torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0]
        else:
            token = scores.argmax(dim=-1)
        return token, scores

    def _unsure(self, token: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """`(..., )` bool: the head's probability of each picked `token` is below the confidence threshold."""
        probs = scores.float().softmax(dim=-1).gather(-1, token[..., None].to(scores.device))[..., 0]
        return probs < self.confidence_threshold

    def _pick_all(
        self, context: torch.LongTensor, draft_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick K drafts from `(1, K, V_draft)` logits of one pass: `(tokens (1, k), logits (1, k, V))`, k <= K."""
        if len(self.logits_processor) == 0:  # no per-depth context needed: one vectorised pick
            scores = self.head.draft_logits_to_target(draft_logits.float())
            if self.do_sample:
                probs = scores.softmax(dim=-1)
                tokens = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])
            else:
                tokens = scores.argmax(dim=-1)
            return tokens, scores
        tokens, rows = [], []
        for d in range(draft_logits.shape[1]):
            picked = self._pick(context, draft_logits[:, d])
            if picked is None:
                break
            tokens.append(picked[0])
            rows.append(picked[1])
            context = torch.cat([context, picked[0][:, None]], dim=-1)
        if not tokens:
            return context.new_zeros(1, 0), draft_logits.new_zeros(1, 0, self.head.config.vocab_size)
        return torch.stack(tokens, dim=1), torch.stack(rows, dim=1)

    # ------------------------------------------------------------------ drafting
    def _draft_parallel(
        self, context: torch.LongTensor, start: int, tokens: torch.LongTensor, feats: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.head
        ids, positions, parallel = head.parallel_slots(tokens, start, k)
        if k > 1:
            feats = torch.cat([feats, feats.new_zeros(1, k - 1, feats.shape[-1])], dim=1)
        out = head(
            input_ids=ids,
            target_hidden_states=feats,
            position_ids=positions,
            past_key_values=self.cache,
            parallel_mask=parallel,
            use_cache=True,
            logits_to_keep=k,
        )
        self.stats.drafter_forward_calls += 1
        self._speculative_slots = k - 1
        tokens, scores = self._pick_all(context, out.logits)
        if self.confidence_threshold > 0:
            unsure = self._unsure(tokens, scores)[0].nonzero()
            if len(unsure):
                keep = int(unsure[0]) + 1  # up to and including the first unsure draft
                tokens, scores = tokens[:, :keep], scores[:, :keep]
        return tokens, scores

    def _draft_autoregressive(
        self, context: torch.LongTensor, start: int, tokens: torch.LongTensor, feats: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.head
        n = start + tokens.shape[1] + 1  # sequence length: real slots end at n-2
        positions = torch.arange(start, n - 1, device=self.device)[None]
        out = head(
            input_ids=tokens,
            target_hidden_states=feats,
            position_ids=positions,
            past_key_values=self.cache,
            parallel_mask=torch.zeros_like(tokens, dtype=torch.bool),
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.drafter_forward_calls += 1
        self._speculative_slots = 0
        drafted, rows = [], []
        for d in range(k):
            picked = self._pick(context, out.logits[:, -1])
            if picked is None:
                break
            drafted.append(picked[0])
            rows.append(picked[1])
            context = torch.cat([context, picked[0][:, None]], dim=-1)
            if d == k - 1:
                break
            if self.confidence_threshold > 0 and bool(self._unsure(*picked)[0]):
                break  # the rest of the round would follow an unsure draft
            # slot for draft d+1 at position n-1+d: token = draft, hidden input = previous last hidden state
            token = picked[0][:, None].to(self.device)
            out = head(
                input_ids=token,
                projected_hidden_states=out.last_hidden_state[:, -1:],
                position_ids=torch.tensor([[n - 1 + d]], device=self.device),
                past_key_values=self.cache,
                parallel_mask=torch.zeros_like(token, dtype=torch.bool),
                use_cache=True,
                logits_to_keep=1,
            )
            self.stats.drafter_forward_calls += 1
            self._speculative_slots += 1
        if not drafted:
            return context.new_zeros(1, 0), out.logits.new_zeros(1, 0, head.config.vocab_size)
        return torch.stack(drafted, dim=1), torch.stack(rows, dim=1)

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
        k = min(self.num_draft_tokens, self.max_length - n - 1)
        if is_first_iteration or model_outputs is None or k < 1:
            self._prev_len = n
            self._last_num_drafts = 0
            return input_ids, None

        tic = time.perf_counter()
        start, tokens, feats = self._new_real_slots(input_ids, model_outputs)
        self.cache.crop(-self._speculative_slots)  # drop last round's speculative slots
        context = input_ids.to(self.device)
        if self.drafting_mode == "autoregressive":
            drafts, logits = self._draft_autoregressive(context, start, tokens, feats, k)
        else:
            drafts, logits = self._draft_parallel(context, start, tokens, feats, k)
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


# ---------------------------------------------------------------------------------------------- the hook
def _wrap_validate_generation_mode(original: Callable) -> Callable:
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        head = (
            generation_mode_kwargs.get("assistant_model")
            if isinstance(generation_mode_kwargs, dict)
            else None
        )
        if isinstance(head, PEagleDrafter):
            _raise_if_incompatible()
            check_generation_request(self, head, generation_config, generation_mode=generation_mode)
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_get_candidate_generator(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        head = arguments.get("assistant_model")
        if not isinstance(head, PEagleDrafter):
            return original(self, *args, **kwargs)
        _raise_if_incompatible()
        generation_config = arguments["generation_config"]
        check_generation_request(self, head, generation_config, batch_size=arguments["input_ids"].shape[0])
        return PEagleCandidateGenerator(self, head, generation_config, arguments.get("logits_processor"))

    return _get_candidate_generator


def install_generate_hook() -> bool:
    """Route `generate(..., assistant_model=<PEagleDrafter>)` to [`PEagleCandidateGenerator`]; idempotent.

    Wraps `GenerationMixin._get_candidate_generator` (the dispatch) and `GenerationMixin._validate_generation_mode`
    (so unsupported requests such as beam search fail with our message before transformers ignores or rejects the
    assistant).  Both wrappers pass every other assistant through untouched.  Returns whether the hook is in place;
    on a transformers without these methods it warns and leaves transformers alone.
    """
    installed = True
    for name in _HOOKED_METHODS:
        current = getattr(GenerationMixin, name, None)
        if current is None:
            warnings.warn(
                f"transformers {transformers.__version__} has no GenerationMixin.{name}; peagle heads cannot draft "
                f"inside generate() (needs transformers>={MIN_TRANSFORMERS_VERSION},<6).",
                stacklevel=2,
            )
            installed = False
            continue
        if getattr(current, "_peagle_hook", False):
            continue
        if name == "_validate_generation_mode":
            if list(inspect.signature(current).parameters) != _VALIDATE_PARAMETERS:
                installed = (
                    False  # unexpected internals: leave it alone; the dispatch hook still raises clearly
                )
                continue
            wrapper = _wrap_validate_generation_mode(current)
        else:
            wrapper = _wrap_get_candidate_generator(current)
        wrapper._peagle_hook = True
        setattr(GenerationMixin, name, wrapper)
    return installed


def uninstall_generate_hook() -> None:
    """Restore transformers' own generation dispatch."""
    for name in _HOOKED_METHODS:
        current = getattr(GenerationMixin, name, None)
        if current is not None and getattr(current, "_peagle_hook", False):
            setattr(GenerationMixin, name, current.__wrapped__)


__all__ = [
    "PEagleCandidateGenerator",
    "PEagleGenerationStats",
    "check_generation_request",
    "resolve_num_draft_tokens",
    "resolve_confidence_threshold",
    "install_generate_hook",
    "uninstall_generate_hook",
    "MIN_TRANSFORMERS_VERSION",
]
