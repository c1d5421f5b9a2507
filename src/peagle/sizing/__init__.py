"""What peagle knows about target families and how big a head gets, one concern per module:

- `families`: the family table (`FAMILIES`, `VLLM_EAGLE3_MODEL_TYPES`), data only;
- `target_config`: reading a target's config into head fields (`target_fields`, `target_model_type`);
- `rule`: the sizing rule (`plan_head`, `round_cost`, the budgets), which `PEagleConfig.for_target` applies;
- `serving`: the export check of the families vLLM serves (`check_export_target`).

Importing this package registers the sizing rule as `PEagleConfig.for_target`'s (the configuration module ships as
remote code and imports nothing from peagle).  torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..configuration_peagle import register_head_sizing
from .families import FAMILIES, VLLM_EAGLE3_MODEL_TYPES, Family, family_name
from .rule import (
    DEFAULT_LAYERS,
    HEAD_BUDGET,
    ROUND_BUDGET,
    ROUND_REAL_SLOTS,
    SLOT_COST,
    VOCAB_CAP,
    VOCAB_COVERAGE,
    VOCAB_FLOOR,
    VOCAB_STEP,
    HeadPlan,
    head_parameters,
    plan_head,
    round_cost,
    target_parameters,
    target_step_cost,
)
from .serving import VLLM_SERVED_LAYOUTS, check_export_target, check_vllm_target
from .target_config import check_target_family, recorded_target_name, target_fields, target_model_type


def sized_config_values(target: Any, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config values of a head for `target` by [`plan_head`], its decisions logged (logger `peagle.sizing`:
    INFO, or WARNING when a default cannot fit a budget)."""
    overrides = dict(overrides or {})
    plan = plan_head(target, overrides)
    chosen = not {"num_hidden_layers", "draft_vocab_size", "embed_from_target"} & set(overrides)
    over = plan.head_parameters > plan.budget and chosen  # a default that cannot fit: say so loudly
    logging.getLogger(__name__).log(logging.WARNING if over else logging.INFO, plan.describe())
    return plan.values


register_head_sizing(sized_config_values)

__all__ = [
    "Family",
    "FAMILIES",
    "VLLM_EAGLE3_MODEL_TYPES",
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
    "VLLM_SERVED_LAYOUTS",
    "check_export_target",
    "check_target_family",
    "check_vllm_target",
    "family_name",
    "head_parameters",
    "plan_head",
    "recorded_target_name",
    "round_cost",
    "sized_config_values",
    "target_fields",
    "target_model_type",
    "target_parameters",
    "target_step_cost",
]
