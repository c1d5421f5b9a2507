"""The serving check of `peagle.export`: vLLM's EAGLE-3 path serves only some target families
([`check_vllm_target`]); peagle's own layout serves every family through transformers."""

from __future__ import annotations

import logging
from typing import Any

from .families import FAMILIES, VLLM_EAGLE3_MODEL_TYPES, family_name
from .target_config import target_model_type

logger = logging.getLogger(__name__)

VLLM_SERVED_LAYOUTS = ("vllm", "speculators")
"""Export layouts that vLLM serves through its EAGLE-3 path (`method: "eagle3"`), so [`check_vllm_target`]
applies to them: peagle's `vllm` layout and the speculators layout (vLLM's `speculators` config type)."""


def check_export_target(head: Any, layout: str, target_model: Any = None) -> None:
    """The family check of `peagle.export`: [`check_vllm_target`] for the layouts vLLM serves
    (`VLLM_SERVED_LAYOUTS`); nothing for peagle's own layout, which transformers serves for every family."""
    if layout in VLLM_SERVED_LAYOUTS:
        check_vllm_target(head, target_model, layout=layout)


def check_vllm_target(head: Any, target_model: Any = None, layout: str = "vllm") -> None:
    """Raise `ValueError` when vLLM 0.32's EAGLE-3 path cannot serve `head` next to its target.

    The target family comes from `target_model` when given, else from `head.config.target_model_type` (recorded
    by `for_target`).  A head that records no family (built by an older peagle, or converted from another
    layout) passes with a warning.  `layout` names the export layout in the message.
    """
    kind = target_model_type(target_model) if target_model is not None else None
    kind = kind or getattr(head.config, "target_model_type", None)
    if kind is None:
        logger.warning(
            "the head does not record its target's family (target_model_type); cannot check that vLLM's EAGLE-3 "
            "path serves it (docs/families.md lists the families it does)."
        )
        return
    if kind not in VLLM_EAGLE3_MODEL_TYPES:
        served = ", ".join(FAMILIES[m].name for m in FAMILIES if FAMILIES[m].vllm_eagle3)
        raise ValueError(
            f"cannot export to the {layout} layout, which vLLM serves through its EAGLE-3 path: vLLM 0.32 cannot "
            f"serve this head: its target family {family_name(kind)} (model_type {kind!r}) has no "
            'EAGLE-3 interface in vLLM (SupportsEagle3), which refuses it with "Model does not support EAGLE3 '
            'interface but aux_hidden_state_outputs was requested". Tested families vLLM serves: '
            f"{served} (docs/families.md). Use the head with transformers' generate() instead, or keep the "
            "peagle layout."
        )


__all__ = ["VLLM_SERVED_LAYOUTS", "check_export_target", "check_vllm_target"]
