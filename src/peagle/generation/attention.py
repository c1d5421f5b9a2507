"""The target's attention in a verify pass: SDPA with its query heads packed onto their key/value heads.

A verify pass runs k + 1 > 1 queries against a long cache with an explicit mask (holes, padding, a tree). For
grouped-query attention, transformers' SDPA path then copies every key and value head once per query head that
shares it (`repeat_kv`) before calling the kernel: at a long context that copy of the whole cache, in every layer
and every pass, costs more than the attention itself. (With one query it packs the query heads instead.) Here the
query heads that share a key/value head are packed along the query axis and the mask is tiled to match, so the
kernel reads the cache as it is; the result is the same attention, computed by the same kernel. The tiled mask
is a copy too, of `groups x queries` entries per key where SDPA's path copies `2 x heads x head_dim` per key: a
pass with that many queries (a long left-padded prompt's prefill) runs SDPA's own path ([`packing_pays`]).

[`packed_attention`] installs it on a target for the length of a `generate()` call, under its own name in
transformers' `AttentionInterface` (and `AttentionMaskInterface`, with SDPA's masks), and gives the target its
own implementation back afterwards. Only targets that run SDPA and use the attention interface take it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

PACKED_SDPA = "peagle_packed_sdpa"
"""The name the packed attention is registered under."""


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with several queries under a shared mask attending through their key/value head
    instead of copies of it. Same arguments and result as `sdpa_attention_forward`; every other case is passed to
    it unchanged."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    packable = (
        groups > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and not module.training
        and kwargs.get("position_bias") is None
        and kwargs.get("s_aux") is None
        and key.shape[1] * groups == query.shape[1]
        and packing_pays(query, key, attention_mask, groups)
    )
    if not packable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, length, dim = query.shape
    # query head h = kv * groups + r (repeat_kv's order): fold r into the query axis, and the mask with it
    packed = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask[..., : key.shape[2]].repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling, is_causal=False
    )
    out = out.reshape(batch, heads, length, out.shape[-1]).transpose(1, 2).contiguous()
    return out, None


def packing_pays(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, groups: int) -> bool:
    """Whether packing copies less than SDPA's own path: packing tiles the mask `groups` times along the queries
    (`groups x Q x S` mask entries per row), SDPA's path copies every key and value head once per query head
    (`2 x heads x S x D` entries).  A verify pass's few queries against a long cache pack; a long prompt's prefill
    with left padding (its queries as many as its keys) does not."""
    tiled = groups * query.shape[2] * mask.element_size()
    copied = 2 * query.shape[1] * key.shape[3] * key.element_size()
    return tiled < copied


def _register() -> None:
    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
        AttentionMaskInterface.register(PACKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def takes_packed_attention(model: torch.nn.Module) -> bool:
    """Whether `model` runs SDPA through transformers' attention interface with grouped-query heads (the case the
    packed attention serves)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "_attn_implementation", None) != "sdpa" or text is None:
        return False
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    return bool(heads and kv_heads and heads > kv_heads)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, `model` (and its sub-configs) runs [`packed_sdpa_forward`] where it ran SDPA; yields whether
    it does. Its own implementation is restored on exit, error or not."""
    if not takes_packed_attention(model):
        yield False
        return
    _register()
    configs = [c for c in _configs(model.config) if getattr(c, "_attn_implementation", None) == "sdpa"]
    for c in configs:
        c._attn_implementation = PACKED_SDPA
    try:
        yield True
    finally:
        for c in configs:
            c._attn_implementation = "sdpa"


def _configs(config) -> list:
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            found.append(sub)
    return found


__all__ = ["PACKED_SDPA", "packed_attention", "packed_sdpa_forward", "packing_pays", "takes_packed_attention"]
