"""The settings of one `generate()` call with a P-EAGLE head, resolved once ([`DraftingSettings`]).

K, the confidence cut (and with it the drafting policy), the tree budget and prompt-lookup branch, the drafter's
attention window, sampling, and which hidden states the target's verify passes return: each from the call's
generation config or peagle's own `generate()` options ([`DraftingOptions`]), else the head's config
(docs/DESIGN.md sections 3.2, 3.3, 7 and 11).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.generation.configuration_utils import GenerationConfig
from transformers.utils import logging

from ..configuration_peagle import MAX_SPECULATIVE_TOKENS, default_aux_layer_ids
from ..modeling_peagle import PEagleDrafter
from ..sizing.target_config import text_config

logger = logging.get_logger(__name__)

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


def resolve_verify_widths(widths: Any, k: int, nodes: int) -> tuple[int, ...]:
    """The widths a call's verify passes are padded to (`verify_widths`), ascending; () for none.

    `"fixed"`: 1 (a plain step), K + 1 (a chain) and, with trees, the node budget + 1.  A list of integers >= 1:
    those.  Each verify pass is padded with slots that are never accepted to the smallest listed width that holds
    it (one that none holds runs as it is), so a compiled forward sees a few shapes only; the output is unchanged.

    >>> resolve_verify_widths("fixed", 4, 0), resolve_verify_widths("fixed", 4, 16), resolve_verify_widths([8, 2], 4, 0)
    ((1, 5), (1, 5, 17), (2, 8))
    """
    if widths is None:
        return ()
    if widths == "fixed":
        return tuple(sorted({1, k + 1} | ({nodes + 1} if nodes else set())))
    if isinstance(widths, (str, bytes)) or not all(
        isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in _iterable(widths)
    ):
        raise ValueError(
            f'verify_widths is {widths!r}; expected "fixed", a list of integers >= 1 (the widths verify passes are '
            "padded to), or None."
        )
    return tuple(sorted(set(widths)))


def padded_width(tokens: int, widths: Sequence[int], room: int | None = None) -> int:
    """The tokens per row a verify pass over `tokens` runs with: the smallest of `widths` (ascending) that holds it
    and fits `room` slots, else `tokens` itself (`verify_widths`; the rule prices a pass at this width).

    >>> padded_width(3, (1, 5, 17)), padded_width(6, (1, 5, 17)), padded_width(6, (1, 5, 17), room=10), padded_width(3, ())
    (5, 17, 6, 3)
    """
    return next((w for w in widths if tokens <= w <= (room or w)), tokens)


def _iterable(value: Any) -> Any:
    try:
        return list(value)
    except TypeError:
        return [None]


RoundObserver = Callable[[list[float], int], None]
"""`observer(confidences, accepted)`: called once per row and verified chain round with the head's probability of
each draft the round verified and how many of them the target accepted (`peagle calibrate` collects its rounds so)."""


@dataclass(frozen=True)
class DraftingOptions:
    """peagle's own `generate()` options (transformers' loop does not know them), as the hook passes them.

    Args:
        draft_tree_size: `"auto"`, None or the most tree nodes per round ([`resolve_tree_settings`]).
        prompt_lookup_num_tokens: the prompt-lookup branch's length, or None.
        drafter_window: the drafter's attention window ([`resolve_drafter_window`]), or None.
        round_observer: told every verified chain round ([`RoundObserver`]), or None.
        verify_widths: `"fixed"` or the widths verify passes are padded to ([`resolve_verify_widths`]), or None.
    """

    draft_tree_size: int | str | None = None
    prompt_lookup_num_tokens: int | None = None
    drafter_window: int | None = None
    round_observer: RoundObserver | None = None
    verify_widths: Any = None


@dataclass(frozen=True)
class PEagleCall:
    """What the hook hands peagle's loop besides transformers' own arguments (`generate(..., peagle=...)`).

    Args:
        head: the drafter (`assistant_model`).
        streamer: the call's streamer (generate() keeps streamers away from custom loops), or None.
        given: which of `num_assistant_tokens` and `assistant_confidence_threshold` the call passed by name.
        options: peagle's own `generate()` options.
    """

    head: PEagleDrafter
    streamer: Any = None
    given: frozenset[str] | None = None
    options: DraftingOptions = dataclasses.field(default_factory=DraftingOptions)


@dataclass(frozen=True)
class DraftingSettings:
    """What one `generate()` call asks of the drafting side, resolved once from the call and the head.

    Args:
        num_speculative_tokens: K, the most drafts per row and round.
        policy: `"fixed"` (threshold 0.0: verify all K), `"threshold"` (the confidence cut) or `"cost"` (no
            threshold: the cost-aware rule, docs/DESIGN.md section 7).
        confidence_threshold: the cut (0.0 without one).
        tree_nodes: the most draft-tree nodes per row and round (0: chains).
        lookup_tokens: the prompt-lookup branch's length (0: none).
        window: the drafter's attention window, or None for the whole context.
        batch_size: the rows the call started with.
        drafting_mode: the head's `"parallel"` or `"autoregressive"`.
        calibration: the head's `draft_calibration`, or None.
        aux_layer_ids: the target layers whose hidden states are the head's features.
        num_target_layers: the target's layer count.
        all_hidden_states: the user asked for every hidden state (the verify passes then return them all).
        do_sample: drafts are sampled (else greedy).
        fast_greedy: greedy without logits processors: drafts and their probabilities come straight from the draft
            vocabulary, and no target-vocabulary scores go back to the loop.
        verify_widths: the widths verify passes are padded to, ascending ([`resolve_verify_widths`]; () for none).
    """

    num_speculative_tokens: int
    policy: str
    confidence_threshold: float
    tree_nodes: int
    lookup_tokens: int
    window: int | None
    batch_size: int
    drafting_mode: str
    calibration: dict[str, Any] | None
    aux_layer_ids: tuple[int, ...]
    num_target_layers: int
    all_hidden_states: bool
    do_sample: bool
    fast_greedy: bool
    verify_widths: tuple[int, ...] = ()

    @classmethod
    def resolve(
        cls,
        target: Any,
        head: PEagleDrafter,
        generation_config: GenerationConfig,
        options: DraftingOptions,
        batch_size: int,
        processors: int,
    ) -> DraftingSettings:
        """The settings of a call on `target` with `head`, its prepared `generation_config`, peagle's own
        `options`, `batch_size` rows and `processors` logits processors."""
        cfg = head.config
        layers = int(text_config(target).num_hidden_layers)
        k = resolve_num_speculative_tokens(generation_config, head)
        threshold = resolve_confidence_threshold(generation_config, head)
        policy = "cost" if threshold is None else ("threshold" if threshold > 0 else "fixed")
        nodes, lookup = resolve_tree_settings(
            options.draft_tree_size, options.prompt_lookup_num_tokens, policy
        )
        window = resolve_drafter_window(options.drafter_window, head)
        if cfg.drafting_mode == "parallel" and k > cfg.num_parallel_positions:
            logger.warning_once(
                f"drafting K={k} tokens per round with a head trained for {cfg.num_parallel_positions} parallel "
                "positions; deeper drafts are rarely accepted."
            )
        do_sample = bool(generation_config.do_sample)
        return cls(
            num_speculative_tokens=k,
            policy=policy,
            confidence_threshold=threshold or 0.0,
            tree_nodes=nodes,
            lookup_tokens=lookup,
            window=window,
            batch_size=int(batch_size),
            drafting_mode=cfg.drafting_mode,
            calibration=getattr(cfg, "draft_calibration", None),
            aux_layer_ids=tuple(cfg.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(layers)),
            num_target_layers=layers,
            all_hidden_states=bool(generation_config.output_hidden_states),
            do_sample=do_sample,
            fast_greedy=not do_sample and processors == 0,
            verify_widths=resolve_verify_widths(options.verify_widths, k, nodes),
        )

    def without_trees(self) -> DraftingSettings:
        """The same settings, verifying chains only."""
        return dataclasses.replace(self, tree_nodes=0, lookup_tokens=0)


__all__ = [
    "AUTO_TREE_NODES",
    "DEFAULT_LOOKUP_TOKENS",
    "DraftingOptions",
    "DraftingSettings",
    "MAX_TREE_NODES",
    "PEagleCall",
    "RoundObserver",
    "resolve_confidence_threshold",
    "resolve_drafter_window",
    "resolve_num_speculative_tokens",
    "resolve_tree_settings",
    "padded_width",
    "resolve_verify_widths",
]
