"""How big a head gets: the sizing rule `PEagleConfig.for_target` applies ([`plan_head`]).

One table (`FAMILIES`) says, per target family, what was tested and whether vLLM's EAGLE-3 path serves it;
`PEagleConfig.for_target`, `peagle export --layout vllm` and docs/families.md all read it.  The rest of the
module is the two rules `for_target` applies:

- **Reading a target** ([`target_fields`]): which head fields come from the target (widths, vocabulary, layer
  count, RoPE of the global-attention layers, token ids) and which are the drafter's own (activation, biases,
  no sliding window, no soft-capping, no embedding scaling, its own LM head), whatever the family calls them.
- **Sizing a head** ([`plan_head`]): two budgets.  The head's own parameters stay within `HEAD_BUDGET` (10%) of
  the target's (the target's embeddings are shared and frozen: not counted, the head does not store them), and
  one drafting round's modeled cost stays within `ROUND_BUDGET` (20%) of one target step's ([`round_cost`],
  [`target_step_cost`]: each weight matrix costs its size times `1 + SLOT_COST * (rows - 1)`, the layers at
  the round's `ROUND_REAL_SLOTS + K - 1` slots, the LM head at K slots, the target's weights at one row).
  The draft vocabulary comes first: the rule keeps the vocabulary the data needs (the smallest covering
  `VOCAB_COVERAGE` of the response tokens, never below `min(V, VOCAB_FLOOR)`; without data the floor) and gives
  the head `DEFAULT_LAYERS` (2) layers if the budgets then still afford that vocabulary, else 1 (with the
  floor kept even when one layer and the floor exceed the round budget: narrow or wide-and-shallow targets).  The draft
  vocabulary may then fill what the budgets leave, in steps of `VOCAB_STEP`, up to `min(V, VOCAB_CAP)` (EAGLE-3
  heads use 32k); with training data `peagle.data.vocab.choose_draft_vocab_size` picks the smallest size in
  that range covering `VOCAB_COVERAGE`.

Importing this module is cheap: torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..configuration_peagle import (
    DEFAULT_NUM_HIDDEN_LAYERS,
    DEFAULT_NUM_PARALLEL_POSITIONS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
)
from .families import FAMILIES, family_name
from .target_config import check_target_family, target_fields, text_config

logger = logging.getLogger(__name__)

HEAD_BUDGET = 0.10
"""Most parameters a default head holds, as a fraction of its target's (shared embeddings not counted)."""
ROUND_BUDGET = 0.20
"""Most modeled cost of one drafting round of a default head, as a fraction of one target step's ([`round_cost`]),
unless one layer and the vocabulary floor already exceed it (the floor is kept).  On this project's CPU the model
is 10-70% above the measured time ratio for a Gemma-3-270M shape and about 2x above it for SmolLM2-135M
(docs/families.md section 4)."""
SLOT_COST = 0.3
"""Cost of one more row (slot) through a weight matrix, relative to the first: a matrix applied to n rows costs
`size * (1 + SLOT_COST * (n - 1))`.  0 is the memory-bound limit (a GPU at small batch), 1 counts FLOPs; 0.3 is
this project's CPU in fp32 on one thread (measured 0.26-0.32 for the drafter's matrices at 1-8 rows)."""
ROUND_REAL_SLOTS = 2
"""Real slots a parallel round feeds the drafter, as the rule counts it (accepted drafts plus the bonus token)."""
DEFAULT_LAYERS = DEFAULT_NUM_HIDDEN_LAYERS
"""Drafter decoder layers by default (the fused layer counts as one); 1 when two leave too small a vocabulary."""
VOCAB_CAP = 32768
"""Largest default draft vocabulary (EAGLE-3 heads use 32k)."""
VOCAB_FLOOR = 8192
"""Smallest draft vocabulary the budget or the data may choose (when the target's vocabulary is larger)."""
VOCAB_STEP = 1024
"""Draft vocabulary sizes are multiples of this (or the whole vocabulary)."""
VOCAB_COVERAGE = 0.995
"""Share of the training data's response tokens the data-chosen draft vocabulary covers (docs/families.md)."""


def head_parameters(values: Mapping[str, Any]) -> int:
    """Parameters a head with these `PEagleConfig` fields stores and trains (shared embeddings not counted).

    `fc` (3 H_t x H), `mask_hidden` (3 H_t), the fused layer (q/k/v read 2H), the plain layers, the norms and the
    LM head (V_draft x H); the embedding table (V x H) unless `embed_from_target`, else the mask embedding (H).
    """
    h, ht = int(values["hidden_size"]), int(values.get("target_hidden_size") or values["hidden_size"])
    heads, hd = (
        int(values["num_attention_heads"]),
        int(values.get("head_dim") or h // int(values["num_attention_heads"])),
    )
    kv = int(values.get("num_key_value_heads") or heads)
    inter, n = int(values["intermediate_size"]), int(values.get("num_hidden_layers", DEFAULT_LAYERS))
    q, k = heads * hd, kv * hd
    bias = (q + 2 * k + h) if values.get("attention_bias") else 0
    mlp = 3 * h * inter + ((2 * inter + h) if values.get("mlp_bias") else 0)
    fused = 2 * h * (q + 2 * k) + q * h + bias + mlp + 3 * h
    plain = h * (q + 2 * k) + q * h + bias + mlp + 2 * h
    vocab = int(values["vocab_size"])
    draft = vocab if values.get("draft_vocab_size") is None else int(values["draft_vocab_size"])
    embed = h if values.get("embed_from_target") else vocab * h
    return 3 * ht * h + 3 * ht + fused + max(n - 1, 0) * plain + h + draft * h + embed


def target_parameters(target: Any) -> tuple[int, Any]:
    """`(parameters, model)`: the target's parameter count (tied weights once) and a model of its class.

    A model is counted as is.  A config is instantiated on the meta device (no memory, no download) through
    `AutoModelForCausalLM.from_config`; the returned model is that meta instance (None if transformers cannot
    build the config, and the count is then estimated from the config's widths).
    """
    if hasattr(target, "parameters") and hasattr(target, "config"):
        seen = {id(p): p.numel() for p in target.parameters()}
        return sum(seen.values()), target
    import torch
    from transformers import AutoModelForCausalLM

    cfg = getattr(target, "config", target)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        logger.info(
            "could not build %s on the meta device (%s); estimating its size", type(cfg).__name__, err
        )
        tc = text_config(cfg)
        try:
            h, v, n = int(tc.hidden_size), int(tc.vocab_size), int(tc.num_hidden_layers)
        except (AttributeError, TypeError):
            return 0, None  # not a decoder config: check_target_family says why
        inter = getattr(tc, "intermediate_size", None) or 4 * h
        tied = getattr(tc, "tie_word_embeddings", False)
        return v * h * (1 if tied else 2) + n * (4 * h * h + 3 * h * int(inter)), None
    return sum({id(p): p.numel() for p in model.parameters()}.values()), model


def _layer_weights(values: Mapping[str, Any]) -> int:
    """Weights a head applies at every slot of a round: `fc`, `mask_hidden`, the layers and norms (no LM head)."""
    h = int(values["hidden_size"])
    return head_parameters({**values, "draft_vocab_size": 0, "embed_from_target": True}) - h


def round_cost(values: Mapping[str, Any], real_slots: int = ROUND_REAL_SLOTS) -> float:
    """Modeled cost of one drafting round of a head with these `PEagleConfig` fields, in weight units.

    A weight matrix of size P applied to n rows costs `P * (1 + SLOT_COST * (n - 1))`.  A parallel round runs the
    layers (with `fc`) over `real_slots + K - 1` slots and the LM head (`draft_vocab_size x hidden_size`) over K
    slots, in one pass.  An autoregressive round runs them over `real_slots` slots, then K - 1 single-slot passes.
    Attention over the context and per-layer overheads are not counted (on either side, see [`target_step_cost`]).
    """
    k = int(values.get("num_speculative_tokens") or DEFAULT_NUM_SPECULATIVE_TOKENS)
    layers = _layer_weights(values)
    vocab = int(values["vocab_size"])
    draft = vocab if values.get("draft_vocab_size") is None else int(values["draft_vocab_size"])
    lm_head = draft * int(values["hidden_size"])

    def rows(n: int) -> float:
        return 1 + SLOT_COST * (max(n, 1) - 1)

    if values.get("drafting_mode", "parallel") == "autoregressive":
        return layers * (rows(real_slots) + (k - 1)) + lm_head * k
    return layers * rows(real_slots + k - 1) + lm_head * rows(k)


def target_step_cost(target: Any, model: Any = None) -> float:
    """Modeled cost of one target step (one new token), in the weight units of [`round_cost`]: the weights the
    target multiplies per token, each applied to one row.

    That is its parameters minus the embedding tables it only looks up (the input table counts when it is tied to
    the LM head), with the experts of a mixture-of-experts layer counted at the active share `k / E`.  `model` is
    the target or a meta-device instance of its class ([`target_parameters`]); without one the cost is estimated
    from the config's widths.
    """
    import torch

    tc = text_config(target)
    experts = (
        getattr(tc, "num_experts", None)
        or getattr(tc, "num_local_experts", None)
        or getattr(tc, "n_routed_experts", None)
    )
    active = getattr(tc, "num_experts_per_tok", None)
    share = float(active) / float(experts) if experts and active else 1.0
    if model is None or not hasattr(model, "named_parameters"):
        h, v, n = int(tc.hidden_size), int(tc.vocab_size), int(tc.num_hidden_layers)
        inter = getattr(tc, "intermediate_size", None) or 4 * h
        return float(v * h + n * (4 * h * h + 3 * h * int(inter)))
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_weight = getattr(out, "weight", None)
    lookups = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight is not out_weight
    }
    cost = 0.0
    for name, p in model.named_parameters():  # tied weights once
        if id(p) in lookups:
            continue
        cost += p.numel() * (share if ".experts." in f".{name}" else 1.0)
    return cost


@dataclasses.dataclass
class HeadPlan:
    """What [`plan_head`] chose for a target, and why.

    Attributes:
        values: the `PEagleConfig` keyword arguments (target fields, chosen sizes, overrides).
        head_parameters: parameters of the head these values describe ([`head_parameters`]).
        target_parameters: the target's parameter count.
        budget: `HEAD_BUDGET * target_parameters`.
        vocab_range: `(smallest, largest)` draft vocabulary the rule allows; training data chooses within it.
        notes: one line per decision (field: value (reason)).
        model_type: the target's model type.
        round_cost: modeled cost of one drafting round of this head ([`round_cost`]).
        step_cost: modeled cost of one target step ([`target_step_cost`]).
    """

    values: dict[str, Any]
    head_parameters: int
    target_parameters: int
    budget: float
    vocab_range: tuple[int, int]
    notes: list[str]
    model_type: str | None
    round_cost: float = 0.0
    step_cost: float = 0.0

    @property
    def fraction(self) -> float:
        return self.head_parameters / max(self.target_parameters, 1)

    @property
    def round_fraction(self) -> float:
        """Modeled round cost / target step cost (the rule keeps default heads within `ROUND_BUDGET`)."""
        return self.round_cost / max(self.step_cost, 1.0)

    @property
    def over_budget(self) -> bool:
        return self.head_parameters > self.budget or self.round_fraction > ROUND_BUDGET + 1e-9

    def describe(self) -> str:
        """A few lines for logs and `peagle train`: sizes, fraction of the target, and every decision's reason."""
        v = self.values
        head = (
            f"head for {family_name(self.model_type)} target ({self.target_parameters / 1e6:.1f}M parameters): "
            f"{v['num_hidden_layers']} layers, width {v['hidden_size']}, draft vocabulary {v['draft_vocab_size']} "
            f"of {v['vocab_size']}, {self.head_parameters / 1e6:.2f}M own parameters = {100 * self.fraction:.1f}% "
            f"of the target (budget {100 * HEAD_BUDGET:.0f}%); a drafting round costs {100 * self.round_fraction:.0f}% "
            f"of a target step (modeled, budget {100 * ROUND_BUDGET:.0f}%)"
        )
        return "\n".join([head, *("  " + n for n in self.notes)])


def _round_down(x: float, step: int) -> int:
    return int(max(x, 0) // step) * step


def plan_head(
    target: Any,
    overrides: Mapping[str, Any] | None = None,
    needed_vocab: int | None = None,
    given: Sequence[str] | None = None,
) -> HeadPlan:
    """Choose a head's config for `target` (a model or a config): the rule of the module docstring.

    Args:
        target: the target model or its config.
        overrides: `PEagleConfig` fields kept as given (and reported when the head then exceeds a budget); the
            others follow the rule.
        needed_vocab: the draft vocabulary the training data needs (`peagle.data.vocab.coverage_vocab_size`:
            the smallest covering `VOCAB_COVERAGE` of its response tokens); None: `min(V, VOCAB_FLOOR)`.  The
            rule drops a layer rather than the vocabulary below this (or below the floor).
        given: the sizes among `overrides` the user chose (default: all of them); the notes on a head over a
            budget call the others the rule's (`build_head` passes a draft vocabulary it chose from data).

    Raises `ValueError` for targets that cannot work ([`check_target_family`]).
    """
    overrides = dict(overrides or {})
    num_params, model = target_parameters(target)
    check_target_family(target, model)
    values, notes, kind = _base_values(target, overrides)
    step_cost = target_step_cost(target, model)
    budgets = _Budgets(values, HEAD_BUDGET * num_params, ROUND_BUDGET * step_cost)
    vocab = int(values["vocab_size"])
    floor = min(vocab, VOCAB_FLOOR)
    layers = _choose_layers(budgets, overrides, needed_vocab, floor, notes)
    draft, cap = _choose_draft(budgets, overrides, layers, floor, notes)
    values["num_hidden_layers"], values["draft_vocab_size"] = layers, draft
    if draft < vocab:
        notes.append(draft_ids_note(draft, vocab))
    plan = HeadPlan(
        values,
        budgets.size(layers, draft),
        num_params,
        budgets.budget,
        (min(floor, cap), cap),
        notes,
        kind,
        budgets.cost(layers, draft),
        step_cost,
    )
    _note_over_budget(
        plan, overrides if given is None else {k: overrides[k] for k in given if k in overrides}, floor
    )
    return plan


def draft_ids_note(draft: int, vocab: int) -> str:
    """What a draft vocabulary smaller than the target's means for a head not yet given its ids, and what to do."""
    return (
        f"draft ids: the head drafts {draft} of the target's {vocab} tokens, for now ids 0..{draft - 1}, "
        "placeholders: train it (`peagle train` and `peagle.training.build_head(target, examples)` pick the "
        "training data's most frequent response tokens) or call `head.set_draft_vocab(select_draft_vocab(...))` "
        "before drafting with it"
    )


def _base_values(target: Any, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], str | None]:
    """The fields read from the target, the drafter's own defaults, the overrides (sizes apart) and K; the notes;
    the target's model type."""
    fields, notes = target_fields(target)
    values: dict[str, Any] = {
        **fields,
        "embed_from_target": True,
        "num_parallel_positions": DEFAULT_NUM_PARALLEL_POSITIONS,
        "drafting_mode": "parallel",
    }
    notes.append("embed_from_target: True (the target's embedding table is shared and frozen, not stored)")
    kind = fields["target_model_type"]
    if kind not in FAMILIES:
        notes.append(
            f"family {kind!r} is not in peagle's tested matrix (docs/families.md); the generic rules apply"
        )
    values.update({k: v for k, v in overrides.items() if k not in ("num_hidden_layers", "draft_vocab_size")})
    k_train = int(values["num_parallel_positions"])
    if "num_speculative_tokens" not in overrides:
        k = DEFAULT_NUM_SPECULATIVE_TOKENS
        if values["drafting_mode"] == "parallel" and k > k_train:
            k = k_train
            notes.append(f"num_speculative_tokens: {k} (K never above K_train = {k_train})")
        values["num_speculative_tokens"] = k
    return values, notes, kind


class _Budgets:
    """A head's parameters and modeled round cost by (layers, draft vocabulary), against the two budgets."""

    def __init__(self, values: Mapping[str, Any], budget: float, round_budget: float):
        self.values, self.budget, self.round_budget = values, budget, round_budget
        self.vocab, self.hidden = int(values["vocab_size"]), int(values["hidden_size"])

    def size(self, layers: int, draft: int) -> int:
        return head_parameters({**self.values, "num_hidden_layers": layers, "draft_vocab_size": draft})

    def cost(self, layers: int, draft: int) -> float:
        return round_cost({**self.values, "num_hidden_layers": layers, "draft_vocab_size": draft})

    def fits(self, layers: int, draft: int) -> bool:
        return self.size(layers, draft) <= self.budget and self.cost(layers, draft) <= self.round_budget

    def room(self, layers: int) -> int:
        """The largest draft vocabulary both budgets afford with `layers` layers (may be below the floor)."""
        if self.vocab <= VOCAB_CAP and self.fits(layers, self.vocab):
            return self.vocab
        by_params = (self.budget - self.size(layers, 0)) / self.hidden
        lm_rows = self.cost(layers, 1) - self.cost(layers, 0)  # cost of one LM-head row at K slots
        by_round = (self.round_budget - self.cost(layers, 0)) / lm_rows
        return min(_round_down(min(by_params, by_round), VOCAB_STEP), VOCAB_CAP, self.vocab)


def _choose_layers(
    budgets: _Budgets, overrides: Mapping[str, Any], needed_vocab: int | None, floor: int, notes: list[str]
) -> int:
    """Given layers; else `DEFAULT_LAYERS`, one dropped at a time while the budgets leave less than the vocabulary
    needed (or, with a given vocabulary, while it does not fit)."""
    given_draft = overrides.get("draft_vocab_size")
    if overrides.get("num_hidden_layers") is not None:
        layers = int(overrides["num_hidden_layers"])
        notes.append(f"num_hidden_layers: {layers} (given)")
        return layers
    layers = DEFAULT_LAYERS
    if given_draft is not None:
        while layers > 1 and not budgets.fits(layers, int(given_draft)):
            layers -= 1
        why = (
            "default"
            if layers == DEFAULT_LAYERS
            else f"{DEFAULT_LAYERS} exceed a budget with the given vocabulary"
        )
        notes.append(f"num_hidden_layers: {layers} ({why})")
        return layers
    needed = max(floor, min(int(needed_vocab or floor), budgets.vocab, VOCAB_CAP))
    why_needed = (
        f"the {needed} ids covering {100 * VOCAB_COVERAGE:.1f}% of the data's response tokens"
        if needed_vocab is not None and needed > floor
        else f"the floor of {floor} ids"
    )
    while layers > 1 and budgets.room(layers) < needed:
        notes.append(
            f"num_hidden_layers: not {layers} (with {layers} layers the budgets leave {max(budgets.room(layers), 0)} "
            f"draft ids, fewer than {why_needed}: a layer is dropped before the vocabulary)"
        )
        layers -= 1
    why = "default" if layers == DEFAULT_LAYERS else "the most that keep the draft vocabulary"
    notes.append(
        f"num_hidden_layers: {layers} ({why}; the budgets leave {max(budgets.room(layers), 0)} draft ids)"
    )
    return layers


def _choose_draft(
    budgets: _Budgets, overrides: Mapping[str, Any], layers: int, floor: int, notes: list[str]
) -> tuple[int, int]:
    """`(draft vocabulary, cap)`: the given size, else what the budgets leave (never below the floor)."""
    cap = max(floor, budgets.room(layers))
    given_draft = overrides.get("draft_vocab_size")
    if given_draft is not None:
        notes.append(f"draft_vocab_size: {int(given_draft)} (given)")
        return int(given_draft), cap
    draft = cap
    why = "the whole vocabulary" if draft == budgets.vocab else (
        f"cap {VOCAB_CAP}" if draft == VOCAB_CAP else (
            f"the floor {floor}" if budgets.room(layers) < floor else "what the budgets leave for the LM head"
        )
    )  # fmt: skip
    notes.append(
        f"draft_vocab_size: {draft} ({why}; with training data the smallest size in [{min(floor, cap)}, {cap}] "
        f"covering {100 * VOCAB_COVERAGE:.1f}% of the response tokens)"
    )
    return draft, cap


def _note_over_budget(plan: HeadPlan, overrides: Mapping[str, Any], floor: int) -> None:
    """Say why a head exceeds a budget: sizes given, or even the smallest default head does not fit."""
    if not plan.over_budget:
        return
    given = [k for k in ("num_hidden_layers", "draft_vocab_size", "embed_from_target") if k in overrides]
    reason = f"given {given}" if given else "even the smallest default head does not fit"
    shrink = (
        "to shrink it, give fewer num_hidden_layers or a smaller draft_vocab_size"
        if given
        else "nothing to do: no default head is smaller"
    )
    if plan.head_parameters > plan.budget:
        plan.notes.append(
            f"over budget: {plan.head_parameters / 1e6:.2f}M > {HEAD_BUDGET:.0%} of "
            f"{plan.target_parameters / 1e6:.2f}M ({reason}). The head takes more memory than the rule plans for "
            f"and still works; {shrink}"
        )
    if plan.round_fraction > ROUND_BUDGET + 1e-9:
        floor_kept = not given and plan.values["draft_vocab_size"] <= floor
        kept = "the vocabulary floor is kept" if floor_kept else reason
        cheaper = (
            f"nothing to do; a draft vocabulary below {floor} would cost less but draft fewer tokens"
            if floor_kept
            else shrink.replace("shrink it", "make rounds cheaper")
        )
        plan.notes.append(
            f"over the round budget: a round costs {plan.round_fraction:.0%} of a target step (modeled) > "
            f"{ROUND_BUDGET:.0%} ({kept}). Drafting still pays where the head's drafts are accepted: generate() "
            f"times both on your machine and drafts only where a round pays; {cheaper}"
        )


__all__ = [
    "draft_ids_note",
    "HEAD_BUDGET",
    "ROUND_BUDGET",
    "SLOT_COST",
    "ROUND_REAL_SLOTS",
    "DEFAULT_LAYERS",
    "VOCAB_CAP",
    "VOCAB_FLOOR",
    "VOCAB_STEP",
    "VOCAB_COVERAGE",
    "HeadPlan",
    "head_parameters",
    "plan_head",
    "round_cost",
    "target_parameters",
    "target_step_cost",
]
