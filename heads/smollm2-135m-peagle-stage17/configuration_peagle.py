"""Configuration of a P-EAGLE drafter head.

A head is a small Llama-style decoder (2 layers by default, see `for_target`) that reads the hidden states of three layers
of a *target* model and drafts K tokens for it.  Every Llama field keeps its meaning; the fields below
add what a drafter needs to know about its target and about parallel drafting.
"""

from __future__ import annotations

import logging
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

DRAFTING_MODES = ("parallel", "autoregressive")


@strict
class PEagleConfig(LlamaConfig):
    r"""Configuration of a [`PEagleDrafter`].

    Llama fields (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
    `head_dim`, `intermediate_size`, `rope_parameters`, `rms_norm_eps`, `attention_bias`, ...) describe
    the drafter itself.  The drafter-specific fields:

    - `vocab_size`: the target's vocabulary size (input embeddings, verification).
    - `draft_vocab_size`: rows of `lm_head`; draft id `i` maps to target id `i + d2t[i]`.
    - `target_hidden_size`: width H_t of the target's hidden states; `fc` maps `3 * H_t -> hidden_size`.
    - `eagle_aux_hidden_state_layer_ids`: target layers whose *inputs* are read
      (`output_hidden_states[i]`, index 0 = embeddings), concatenated in that order.
    - `target_num_hidden_layers`: number of decoder layers of the target (for validation).
    - `mask_token_id`: the reserved id whose embedding is the learned mask embedding of parallel slots.
    - `num_parallel_positions`: K_train, the parallel depth the head was trained for.
    - `num_speculative_tokens`: default K at inference.
    - `confidence_threshold`: default draft-confidence cut at inference, used when `generate()` is not given
      `assistant_confidence_threshold`: a round ends after its first draft the head gives a lower probability;
      0.0 drafts K tokens every round (vLLM's behaviour).  None (the default) selects cost-aware drafting: each
      round verifies the number of drafts that maximises expected tokens per second on the machine at hand.
    - `draft_calibration`: per-depth map from the head's confidence in a draft to the probability that the
      target accepts it (`{"method": "isotonic", "x": [[...]], "y": [[...]], ...}`), fitted on held-out text;
      None: the raw confidence.
    - `drafting_mode`: `"parallel"` (P-EAGLE: K drafts in one pass) or `"autoregressive"` (EAGLE-3 heads).
    - `norm_before_residual`: residual of the fused layer is `hidden_norm(h)` instead of `h`.
    - `embed_from_target`: the token embeddings are the target's (not stored with the head); only the
      mask embedding is learned and stored (`mask_embedding`).
    - `target_model_name`: name or path of the target the head was trained for.
    - `target_model_type`: transformers' `model_type` of the target (`"llama"`, `"gemma3_text"`, ...); export
      checks it against the families the serving engine supports (`peagle.families`).

    Example:

    ```python
    >>> from transformers import LlamaConfig
    >>> from peagle import PEagleConfig
    >>> target = LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, vocab_size=128)
    >>> cfg = PEagleConfig.for_target(target, num_hidden_layers=2)
    >>> cfg.eagle_aux_hidden_state_layer_ids
    [2, 4, 5]
    >>> cfg.embed_from_target, cfg.target_model_type
    (True, 'llama')

    ```
    """

    model_type = "peagle"

    num_hidden_layers: int = 4
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    target_num_hidden_layers: int | None = None
    mask_token_id: int | None = None
    num_parallel_positions: int = 8
    num_speculative_tokens: int = 7
    confidence_threshold: float | None = None
    draft_calibration: dict | None = None
    drafting_mode: str = "parallel"
    norm_before_residual: bool = False
    embed_from_target: bool = False
    target_model_name: str | None = None
    target_model_type: str | None = None

    def __post_init__(self, **kwargs):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if self.eagle_aux_hidden_state_layer_ids is not None:
            self.eagle_aux_hidden_state_layer_ids = [int(i) for i in self.eagle_aux_hidden_state_layer_ids]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Checks run by `@strict` whenever a config is built or loaded."""
        super().validate_architecture()
        if self.drafting_mode not in DRAFTING_MODES:
            raise ValueError(f"drafting_mode is {self.drafting_mode!r}; expected one of {DRAFTING_MODES}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size is {self.draft_vocab_size}, larger than vocab_size {self.vocab_size}; "
                "the draft vocabulary must be a subset of the target's."
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id is {self.mask_token_id}; expected an id in [0, {self.vocab_size})."
            )
        if self.embed_from_target and self.target_hidden_size not in (None, self.hidden_size):
            raise ValueError(
                f"embed_from_target needs hidden_size == target_hidden_size, got {self.hidden_size} "
                f"and {self.target_hidden_size}."
            )
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and len(ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids is {ids}; expected exactly 3 layer ids.")
        if ids is not None and self.target_num_hidden_layers is not None:
            check_aux_layer_ids(ids, self.target_num_hidden_layers)
        if self.num_parallel_positions < 1 or self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_parallel_positions ({self.num_parallel_positions}) and num_speculative_tokens "
                f"({self.num_speculative_tokens}) must be >= 1."
            )
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(
                f"confidence_threshold is {self.confidence_threshold!r}; expected a probability in [0, 1]."
            )

    @property
    def num_aux_layers(self) -> int:
        return 3

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> PEagleConfig:
        """A config sized for `target` (a model, or its config), by the rules of `peagle.families`.

        From the target: widths (hidden size, heads, kv heads, head_dim, intermediate size), vocabulary, layer
        count and aux layers `(2, L//2, L-3)` (`(1, L//2, L-1)` when L < 8), the RoPE of its global-attention
        layers, eps, token ids.  The drafter's own: SiLU, no biases, full attention, the target's embeddings shared
        and frozen (`embed_from_target=True`), a draft vocabulary of 8k-32k, at most 10% of the target's parameters,
        and a drafting round that costs at most 20% of a target step (modeled: `peagle.families.round_cost`); the
        vocabulary is kept first, then `DEFAULT_LAYERS` (2) layers if the budgets still allow, else 1;
        K = min(7, K_train).
        `mask_token_id` defaults to `vocab_size - 1` (pass a reserved token of your tokenizer instead when it has
        one).  Every field can be overridden by keyword.  The sizes chosen and why are logged (logger
        `peagle.families`, level INFO); `peagle.families.plan_head` returns them.  Raises `ValueError` naming the
        family for targets that cannot work (encoder-decoder, stateful).
        """
        try:  # peagle's own module, absent when this file runs as Hub remote code (nothing builds heads there)
            from peagle.families import plan_head
        except ImportError as err:
            raise ImportError(
                "PEagleConfig.for_target needs the peagle package (pip install peagle); loading a saved head "
                "does not."
            ) from err
        plan = plan_head(target, overrides)
        log = logging.getLogger("peagle.families")
        chosen = not {"num_hidden_layers", "draft_vocab_size", "embed_from_target"} & set(overrides)
        over = plan.head_parameters > plan.budget and chosen  # a default that cannot fit: say so loudly
        log.log(logging.WARNING if over else logging.INFO, plan.describe())
        return cls(**plan.values)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers for an L-layer target: `(2, L//2, L-3)`, or `(1, L//2, L-1)` if L < 8."""
    if num_layers < 1:
        raise ValueError(f"target has {num_layers} layers; expected at least 1.")
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    return [min(1, num_layers - 1), num_layers // 2, num_layers - 1]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> None:
    """Raise if an aux layer id is not the input of one of the target's `num_layers` decoder layers."""
    bad = [i for i in ids if not 0 <= int(i) < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {list(ids)} include {bad}, outside the target's layers: expected ids in "
            f"[0, {num_layers - 1}] (id i = input of decoder layer i = output_hidden_states[i])."
        )


__all__ = ["PEagleConfig", "default_aux_layer_ids", "check_aux_layer_ids"]
