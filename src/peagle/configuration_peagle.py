"""Configuration of a P-EAGLE drafter head.

A head is a small Llama-style decoder (default 4 layers) that reads the hidden states of three layers
of a *target* model and drafts K tokens for it.  Every Llama field keeps its meaning; the fields below
add what a drafter needs to know about its target and about parallel drafting.
"""

from __future__ import annotations

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

    Example:

    ```python
    >>> from transformers import LlamaConfig
    >>> from peagle import PEagleConfig
    >>> target = LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, vocab_size=128)
    >>> cfg = PEagleConfig.for_target(target, num_hidden_layers=2)
    >>> cfg.eagle_aux_hidden_state_layer_ids
    [2, 4, 5]

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
    def for_target(cls, target_config: Any, **overrides: Any) -> PEagleConfig:
        """Build a config that fits `target_config` (a Llama-family config, or a model holding one).

        Defaults: 4 layers; width, heads, kv heads, head_dim, intermediate size, RoPE, eps and vocab from
        the target; aux layers `(2, L//2, L-3)` for an L-layer target (`(1, L//2, L-1)` when L < 8);
        `mask_token_id = vocab_size - 1` (pass a reserved token of your tokenizer instead when it has one).
        Every field can be overridden by keyword.
        """
        tc = getattr(target_config, "config", target_config)
        if hasattr(tc, "get_text_config"):
            tc = tc.get_text_config()
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if not hasattr(tc, k)
        ]
        if missing:
            raise ValueError(
                f"target config {type(tc).__name__} lacks {missing}; expected a Llama-family config."
            )
        num_layers = int(tc.num_hidden_layers)
        heads = int(tc.num_attention_heads)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        rope = getattr(tc, "rope_parameters", None)
        if rope is not None and isinstance(rope, dict) and "rope_type" in rope:
            rope = dict(rope)
        else:
            rope = {"rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
        values: dict[str, Any] = {
            "hidden_size": tc.hidden_size,
            "intermediate_size": getattr(tc, "intermediate_size", 4 * tc.hidden_size),
            "num_hidden_layers": 4,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
            "head_dim": head_dim,
            "hidden_act": getattr(tc, "hidden_act", "silu"),
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 8192),
            "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-5),
            "rope_parameters": rope,
            "attention_bias": False,
            "vocab_size": tc.vocab_size,
            "target_hidden_size": tc.hidden_size,
            "target_num_hidden_layers": num_layers,
            "eagle_aux_hidden_state_layer_ids": default_aux_layer_ids(num_layers),
            "target_model_name": getattr(tc, "_name_or_path", None) or None,
            "tie_word_embeddings": False,
            "bos_token_id": getattr(tc, "bos_token_id", None),
            "eos_token_id": getattr(tc, "eos_token_id", None),
            "pad_token_id": getattr(tc, "pad_token_id", None),
        }
        values.update(overrides)
        return cls(**values)


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
