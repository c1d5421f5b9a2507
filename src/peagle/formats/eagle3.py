"""The ``"eagle3"`` layout: EAGLE-3 research heads (SafeAILab, SpecForge, vLLM EAGLE-3 without a mask token).

The tensor names and config of `formats.vllm` without `mask_hidden` and without a mask token id; loaded with
`drafting_mode="autoregressive"` (K drafts in K forward passes, docs/DESIGN.md section 3).  Such heads
usually share the target's embeddings (no `embed_tokens.weight`): load them with `target=`.  peagle does
not write this layout: export an autoregressive head as ``"vllm"`` (vLLM's EAGLE-3 drafter reads it).

Checked against SafeAILab/EAGLE `eagle/model/cnets.py` @ 148042c5: `midlayer` (`hidden_norm`,
`input_layernorm`, `post_attention_layernorm`, no attention bias), residual = the un-normed hidden state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .io import Checkpoint, TensorSource
from .vllm import flat_to_peagle, has_mask_token, is_flat_eagle3, tensor_name

NAME = "eagle3"
__all__ = ["NAME", "detect", "to_peagle", "tensor_name"]


def detect(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """EAGLE-3 tensors in a flat Llama config, without a mask token (autoregressive drafting)."""
    return is_flat_eagle3(config, tensor_names) and not has_mask_token(config, tensor_names)


def to_peagle(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorSource]
) -> tuple[dict[str, Any], dict[str, TensorSource]]:
    """(PEagleConfig kwargs, peagle name -> tensor) of an EAGLE-3 research head."""
    return flat_to_peagle(checkpoint, tensors, parallel=False)
