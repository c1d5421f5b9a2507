"""Configuration of a P-EAGLE drafter head.

A head is a small Llama-style decoder (2 layers by default, see `for_target`) that reads the hidden states of three layers
of a *target* model and drafts K tokens for it.  Every Llama field keeps its meaning; the fields below
add what a drafter needs to know about its target and about parallel drafting.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

DRAFTING_MODES = ("parallel", "autoregressive")
CALIBRATION_METHODS = ("isotonic",)
"""The `draft_calibration["method"]` values the drafting rule knows (`peagle.generation.calibration` fits them)."""
DEFAULT_NUM_HIDDEN_LAYERS = 2
"""Decoder layers of a head when nothing else decides (the size rule, `peagle.sizing`, starts from this)."""
DEFAULT_NUM_PARALLEL_POSITIONS = 8
"""K_train of a head when nothing else decides (training arguments left None read it from the head's config)."""
DEFAULT_NUM_SPECULATIVE_TOKENS = 7
"""K, the drafts per round at inference, when nothing else decides (a parallel head: never above its K_train)."""
MAX_SPECULATIVE_TOKENS = 64
"""Upper bound on `num_speculative_tokens` (K) and `num_parallel_positions` (K_train) in a config.

A round appends K - 1 parallel slots to the drafter's pass and the cost rule times target passes over 1..K + 1
tokens, so both grow with K; acceptance decays geometrically with depth (the shipped heads accept under 20% of
their 7th drafts), and P-EAGLE heads are trained and served with K of 5 to 16.  64 leaves four times that room while
a stray 3e7 in config.json fails at once instead of allocating gigabytes in `generate()`."""
_INT_FIELDS = {  # field -> (smallest value, largest value or None, None allowed)
    "vocab_size": (1, None, False),
    "hidden_size": (1, None, False),
    "intermediate_size": (1, None, False),
    "num_hidden_layers": (1, None, False),
    "num_attention_heads": (1, None, False),
    "num_key_value_heads": (1, None, True),
    "head_dim": (1, None, True),
    "max_position_embeddings": (1, None, False),
    "draft_vocab_size": (1, None, True),
    "target_hidden_size": (1, None, True),
    "target_num_hidden_layers": (1, None, True),
    "mask_token_id": (0, None, True),
    "num_parallel_positions": (1, MAX_SPECULATIVE_TOKENS, False),
    "num_speculative_tokens": (1, MAX_SPECULATIVE_TOKENS, False),
    "drafter_window": (1, None, True),
}
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size", "embed_from_target",
    "mlp_bias", "attention_bias",
)  # fmt: skip
"""Config fields that size a head's weights: fixed by its checkpoint."""
_FLOAT_FIELDS = {  # field -> `number_problem` bounds
    "rms_norm_eps": {"low": 0.0, "low_open": True},
    "initializer_range": {"low": 0.0},
    "attention_dropout": {"low": 0.0, "high": 1.0, "high_open": True},
}
_BOOL_FIELDS = ("norm_before_residual", "embed_from_target")
_STR_FIELDS = ("target_model_name", "target_model_type")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_field_values(config: Any) -> None:
    """Raise `ValueError` naming every peagle or Llama size field whose value has the wrong type or range.

    Values read from config.json are never coerced: `"7"`, `7.0`, `2.5` or `true` for an integer field, a string of
    aux layer ids, or a K above `MAX_SPECULATIVE_TOKENS` are refused; all such fields are named in one message.
    """
    problems = []
    for name, (lo, hi, optional) in _INT_FIELDS.items():
        value = getattr(config, name, None)
        if value is None and optional:
            continue
        if not _is_int(value):
            problems.append(f"{name} is {value!r} ({type(value).__name__}); expected an integer")
        elif value < lo or (hi is not None and value > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            why = " (peagle's bound on K, MAX_SPECULATIVE_TOKENS)" if hi is not None else ""
            problems.append(f"{name} is {value}; expected an integer {bound}{why}")
    for name, bounds in _FLOAT_FIELDS.items():
        if hasattr(config, name):
            problems.append(number_problem(name, getattr(config, name), **bounds))
    problems += _rope_problems(getattr(config, "rope_parameters", None))
    for name in _BOOL_FIELDS:
        value = getattr(config, name, None)
        if not isinstance(value, bool):
            problems.append(f"{name} is {value!r} ({type(value).__name__}); expected true or false")
    for name in _STR_FIELDS:
        value = getattr(config, name, None)
        if value is not None and not isinstance(value, str):
            problems.append(f"{name} is {value!r} ({type(value).__name__}); expected a string or null")
    if not isinstance(config.drafting_mode, str) or config.drafting_mode not in DRAFTING_MODES:
        problems.append(f"drafting_mode is {config.drafting_mode!r}; expected one of {DRAFTING_MODES}")
    ids = config.eagle_aux_hidden_state_layer_ids
    if ids is not None and (
        not isinstance(ids, (list, tuple)) or len(ids) != 3 or not all(_is_int(i) and i >= 0 for i in ids)
    ):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids is {ids!r}; expected a list of exactly 3 target layer ids "
            "(integers >= 0)"
        )
    threshold = config.confidence_threshold
    if threshold is not None and (not _is_number(threshold) or not 0.0 <= threshold <= 1.0):
        problems.append(
            f"confidence_threshold is {threshold!r}; expected a probability in [0, 1] or null (cost-aware drafting)"
        )
    try:
        check_draft_calibration(config.draft_calibration)
    except ValueError as err:
        problems.append(str(err).rstrip("."))
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("; ".join(problems) + ".")


def refuse_shape_overrides(overrides: Any, where: Any) -> None:
    """Raise `ValueError` when `overrides` (keywords of a load) set a field of `SHAPE_FIELDS`: the checkpoint's
    tensors fix those."""
    shaped = sorted(set(overrides) & set(SHAPE_FIELDS))
    if shaped:
        raise ValueError(
            f"{', '.join(shaped)} cannot be overridden when loading {where}: they size the stored weights. Load the "
            "head as saved, or build a new one with PEagleConfig(...) / PEagleConfig.for_target(...)."
        )


def number_problem(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> str | None:
    """Why `value` of setting `name` is not a finite number in the range from `low` to `high` (None: no upper
    bound; `low_open` / `high_open` exclude the bound itself), or None.

    >>> number_problem("ttt_decay", -1.0, 0.0, 1.0, low_open=True)
    'ttt_decay is -1.0; expected a finite number in (0.0, 1.0]'
    >>> number_problem("rms_norm_eps", 1e-6, 0.0, low_open=True) is None
    True
    """
    ok = _is_number(value) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if ok:
        return None
    if high is None:
        bound = f"{'>' if low_open else '>='} {low}"
    else:
        bound = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return f"{name} is {value!r}; expected a finite number {bound}"


def _rope_problems(rope: Any) -> list[str]:
    """What is wrong with a config's `rope_parameters` (the drafter's RoPE: a type transformers knows and a
    positive theta), as messages naming the key."""
    if rope is None:
        return []
    if not isinstance(rope, Mapping):
        return [f"rope_parameters is {rope!r} ({type(rope).__name__}); expected an object"]
    problems = []
    kind = rope.get("rope_type", rope.get("type"))
    if not isinstance(kind, str) or kind not in ROPE_INIT_FUNCTIONS and kind != "default":
        known = sorted({"default", *ROPE_INIT_FUNCTIONS})
        problems.append(f"rope_parameters.rope_type is {kind!r}; expected one of {known}")
    for key in ("rope_theta", "factor"):
        if rope.get(key) is not None:
            problems.append(number_problem(f"rope_parameters.{key}", rope[key], 0.0, low_open=True))
    return [p for p in problems if p]


def check_draft_calibration(calibration: Any) -> None:
    """Raise `ValueError` unless `calibration` is None or a `draft_calibration` the drafting rule can use.

    Expected: `{"method": "isotonic", "x": [[...] per depth], "y": [[...] per depth], ...}` (other keys, such as
    the fit's `report` and `data`, are kept as they are): as many maps in `x` as in `y`, at least one; per depth
    equal lengths (at least one knot), finite numbers, `x` non-decreasing, `y` in [0, 1].

    >>> check_draft_calibration({"method": "isotonic", "x": [[0.2, 0.1]], "y": [[0.1, 0.5]]})
    Traceback (most recent call last):
    ...
    ValueError: draft_calibration.x[0] is [0.2, 0.1]; expected non-decreasing confidences (a monotone map).
    """
    if calibration is None:
        return
    if not isinstance(calibration, dict):
        raise ValueError(
            f"draft_calibration is {calibration!r}; expected null or an object "
            '{"method": "isotonic", "x": [[...]], "y": [[...]]}.'
        )
    method = calibration.get("method")
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"draft_calibration.method is {method!r}; expected one of {CALIBRATION_METHODS}.")
    maps = {}
    for key in ("x", "y"):
        value = calibration.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(m, list) and m for m in value):
            raise ValueError(
                f"draft_calibration.{key} is {value!r}; expected a non-empty list of non-empty lists (one map per "
                "depth)."
            )
        for d, m in enumerate(value):
            if not all(_is_number(v) and math.isfinite(v) for v in m):
                raise ValueError(f"draft_calibration.{key}[{d}] is {m!r}; expected finite numbers.")
        maps[key] = value
    xs, ys = maps["x"], maps["y"]
    if len(xs) != len(ys):
        raise ValueError(
            f"draft_calibration has {len(xs)} maps in x and {len(ys)} in y; expected one (x, y) pair per depth."
        )
    for d, (x, y) in enumerate(zip(xs, ys)):
        if len(x) != len(y):
            raise ValueError(
                f"draft_calibration.x[{d}] has {len(x)} knots and y[{d}] {len(y)}; expected equal lengths."
            )
        if any(b < a for a, b in zip(x, x[1:])):
            raise ValueError(
                f"draft_calibration.x[{d}] is {x}; expected non-decreasing confidences (a monotone map)."
            )
        if any(not 0.0 <= v <= 1.0 for v in y):
            raise ValueError(f"draft_calibration.y[{d}] is {y}; expected probabilities in [0, 1].")


def config_file_of(path: str | os.PathLike) -> str:
    """The config.json a `from_pretrained` argument names (a folder's, or the file itself), for error messages."""
    text = os.fspath(path)
    return text if text.endswith(".json") else os.path.join(text, "config.json")


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
    - `drafter_window`: default attention window of the drafter at inference, used when `generate()` is not given
      `drafter_window`: each round the head attends over its last W slots only (a head trained on short
      sequences keeps its acceptance on long ones, and its rounds stop growing with the context).  None (the
      default): the whole context.
    - `drafting_mode`: `"parallel"` (P-EAGLE: K drafts in one pass) or `"autoregressive"` (EAGLE-3 heads).
    - `norm_before_residual`: residual of the fused layer is `hidden_norm(h)` instead of `h`.
    - `embed_from_target`: the token embeddings are the target's (not stored with the head); only the
      mask embedding is learned and stored (`mask_embedding`).
    - `target_model_name`: name or path of the target the head was trained for.
    - `target_model_type`: transformers' `model_type` of the target (`"llama"`, `"gemma3_text"`, ...); export
      checks it against the families the serving engine supports (`peagle.sizing`).

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

    num_hidden_layers: int = DEFAULT_NUM_HIDDEN_LAYERS
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    target_num_hidden_layers: int | None = None
    mask_token_id: int | None = None
    num_parallel_positions: int = DEFAULT_NUM_PARALLEL_POSITIONS
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    confidence_threshold: float | None = None
    draft_calibration: dict | None = None
    drafter_window: int | None = None
    drafting_mode: str = "parallel"
    norm_before_residual: bool = False
    embed_from_target: bool = False
    target_model_name: str | None = None
    target_model_type: str | None = None

    def __post_init__(self, **kwargs):
        check_field_values(self)  # before any default is derived from a value of the wrong type
        for name in _INT_FIELDS:  # numpy / torch integers as plain ints (lossless; JSON writes only ints)
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                setattr(self, name, int(value))
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if self.eagle_aux_hidden_state_layer_ids is not None:
            self.eagle_aux_hidden_state_layer_ids = [int(i) for i in self.eagle_aux_hidden_state_layer_ids]
        super().__post_init__(**kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' `from_pretrained`; an invalid value is an error naming the field and the config.json.

        Keyword overrides (`PEagleDrafter.from_pretrained(folder, confidence_threshold=0.3)`) pass the same checks
        as the file's values; the fields that size the stored weights cannot be overridden (the checkpoint's
        tensors would not fit them)."""
        refuse_shape_overrides(kwargs, pretrained_model_name_or_path)
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
            config = loaded[0] if isinstance(loaded, tuple) else loaded
            config.validate_architecture()  # keyword overrides were set after the file's values were checked
            return loaded
        except (ValueError, TypeError, StrictDataclassError) as err:
            where = config_file_of(pretrained_model_name_or_path)
            given = sorted(k for k in kwargs if k in cls.__dataclass_fields__)
            if given:
                where += f" with from_pretrained keyword(s) {', '.join(given)}"
            raise _in_file(err, where) from err

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' `from_dict`; errors name the config.json when the caller says where it came from
        (`AutoConfig.from_pretrained` passes `name_or_path`)."""
        where = kwargs.get("name_or_path")
        try:
            return super().from_dict(config_dict, **kwargs)
        except (ValueError, TypeError, StrictDataclassError) as err:
            if not where:
                raise
            raise _in_file(err, config_file_of(where)) from err

    def validate_architecture(self):
        """Checks run by `@strict` whenever a config is built or loaded."""
        check_field_values(self)
        super().validate_architecture()
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

    @property
    def num_aux_layers(self) -> int:
        return 3

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> PEagleConfig:
        """A config sized for `target` (a model, or its config), by the rules of `peagle.sizing`.

        From the target: widths (hidden size, heads, kv heads, head_dim, intermediate size), vocabulary, layer
        count and aux layers `(2, L//2, L-3)` (`(1, L//2, L-1)` when L < 8), the RoPE of its global-attention
        layers, eps, token ids.  The drafter's own: SiLU, no biases, full attention, the target's embeddings shared
        and frozen (`embed_from_target=True`), a draft vocabulary of 8k-32k, at most 10% of the target's parameters,
        and a drafting round that costs at most 20% of a target step (modeled: `peagle.sizing.round_cost`); the
        vocabulary is kept first, then `DEFAULT_NUM_HIDDEN_LAYERS` (2) layers if the budgets still allow, else 1;
        K = min(7, K_train).
        `mask_token_id` defaults to `vocab_size - 1` (pass a reserved token of your tokenizer instead when it has
        one).  Every field can be overridden by keyword.  The sizes chosen and why are logged (logger
        `peagle.sizing`, level INFO); `peagle.sizing.plan_head` returns them.  Raises `ValueError` naming the
        family for targets that cannot work (encoder-decoder, stateful).

        The sizing rule is peagle's, not this file's (which ships as remote code and imports nothing from peagle):
        `peagle.sizing` registers it here on import ([`register_head_sizing`]).
        """
        if _HEAD_SIZING is None:  # this file running as Hub remote code: nothing builds heads there
            raise ImportError(
                "PEagleConfig.for_target needs the peagle package (pip install peagle); loading a saved head "
                "does not."
            )
        return cls(**_HEAD_SIZING(target, overrides))


_HEAD_SIZING: Any = None
"""`(target, overrides) -> config values`, registered by `peagle.sizing`."""


def register_head_sizing(sizing: Any) -> None:
    """Install the function [`PEagleConfig.for_target`] sizes heads with (`peagle.sizing` calls this on import)."""
    global _HEAD_SIZING
    _HEAD_SIZING = sizing


def _in_file(err: Exception, where: str) -> ValueError:
    """`err` as a `ValueError` whose message starts with the config file (once), the strict-dataclass wrapping
    dropped."""
    message = str(err)
    if isinstance(err, StrictDataclassError) and isinstance(err.__cause__, (ValueError, TypeError)):
        message = str(err.__cause__)  # huggingface_hub's StrictDataclass*Error: our own message is the cause
    return ValueError(message if where in message else f"{where}: {message}")


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


__all__ = [
    "PEagleConfig",
    "DEFAULT_NUM_HIDDEN_LAYERS",
    "DEFAULT_NUM_PARALLEL_POSITIONS",
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "MAX_SPECULATIVE_TOKENS",
    "register_head_sizing",
    "default_aux_layer_ids",
    "check_aux_layer_ids",
    "check_draft_calibration",
]
