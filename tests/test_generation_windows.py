"""Sliding windows by position (`peagle.generation.windows`): the masks reproduce transformers' own window on a
cache whose slots are not positions (holes, left padding), for every sliding-window family of the matrix."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer

from peagle.drafting_peagle import custom_attention_mask
from peagle.generation.windows import (
    FULL,
    SLIDING,
    LayerWindows,
    full_cache_layers,
    layer_windows,
    slot_positions,
    windowed_masks,
)
from test_families import COMMON, CONFIGS

SLIDING_FAMILIES = ["gemma2", "gemma3_text", "gpt_oss", "mistral"]
NO_SDPA = {
    ("gemma2", "sdpa"),
    ("gpt_oss", "sdpa"),
}  # transformers refuses SDPA for these (soft-capping, sinks)


def sliding_target(family: str, attn: str):
    cls, extra = CONFIGS[family]
    config = cls(**{**COMMON, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_layer_windows_by_family():
    assert layer_windows(transformers.LlamaConfig(**COMMON)) is None
    mistral = layer_windows(transformers.MistralConfig(**COMMON, sliding_window=8))
    assert mistral == LayerWindows({SLIDING: 8}, keyed=False) and mistral.slides
    gemma = layer_windows(sliding_target("gemma3_text", "eager").config)
    assert gemma == LayerWindows({FULL: None, SLIDING: 8}, keyed=True)
    qwen = transformers.Qwen2Config(**COMMON)  # layer types, none sliding
    assert layer_windows(qwen) is None
    chunked = transformers.LlamaConfig(**COMMON)
    chunked.layer_types = ["chunked_attention", "full_attention"] * 2
    chunked.sliding_window = 8
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows(chunked)


def test_windowed_masks_apply_each_kind_by_position():
    allowed = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    allowed[..., 2] = False  # a hole
    keys = torch.tensor([[0, 1, 0, 2, 3, 4]])
    queries = torch.tensor([[3, 4, 5]])
    masks = windowed_masks(allowed, keys, queries, LayerWindows({FULL: None, SLIDING: 2}, keyed=True))
    assert torch.equal(masks[FULL], allowed)
    want = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    # query at position 3 sees positions 2, 3 (and 4 is not masked by the window: causality is `allowed`'s job)
    assert torch.equal(masks[SLIDING][0, 0], want & allowed[0, 0])
    single = windowed_masks(allowed, keys, queries, LayerWindows({SLIDING: 2}, keyed=False))
    assert torch.equal(single, masks[SLIDING])


def test_slot_positions_skip_holes_and_padding():
    valid = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 1, 1]])
    assert slot_positions(valid).tolist() == [[0, 0, 0, 1, 0, 2], [0, 1, 2, 0, 3, 4]]


def test_full_cache_layers_replaces_sliding_layers_of_an_empty_cache():
    model = sliding_target("gemma3_text", "eager")
    cache = DynamicCache(config=model.config)
    assert any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    assert full_cache_layers(cache)
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    assert not full_cache_layers(cache)
    used = DynamicCache(config=model.config)
    model(torch.tensor([[3, 4, 5]]), past_key_values=used, use_cache=True)
    with pytest.raises(ValueError, match="before the prefill"):
        full_cache_layers(used)


@pytest.mark.parametrize(
    ("family", "attn"),
    [(f, a) for f in SLIDING_FAMILIES for a in ("eager", "sdpa") if (f, a) not in NO_SDPA],
)
def test_window_by_position_matches_the_model_past_holes_and_padding(family, attn):
    """Two left-padded rows; after a prefill longer than the window, rejected drafts stay in the cache as holes
    and the next block is verified with windows by position: its logits equal those of one plain forward over
    the same tokens (transformers' own masks, no holes), so the window neither shifted nor shrank."""
    model = sliding_target(family, attn)
    windows = layer_windows(model.config)
    torch.manual_seed(1)
    tokens = torch.randint(3, 128, (2, 24))
    pad = [0, 5]  # row 1 starts 5 slots later
    prefix, block = 14, 4
    reference = []
    for row in range(2):
        ids = tokens[row : row + 1, pad[row] : prefix + block]
        with torch.no_grad():
            logits = model(ids).logits[0, -block:]
        reference.append(logits)

    cache = DynamicCache(config=model.config)
    full_cache_layers(cache)
    valid = torch.ones(2, prefix, dtype=torch.long)
    valid[1, : pad[1]] = 0
    ids = tokens[:, :prefix].clone()
    ids[1, : pad[1]] = 0
    pos = slot_positions(valid)
    with torch.no_grad():
        model(ids, attention_mask=valid, position_ids=pos, past_key_values=cache, use_cache=True)
        # three drafts that are then rejected: their slots become holes
        drafts = torch.randint(3, 128, (2, 3))
        next_pos = valid.sum(-1, keepdim=True)
        draft_pos = next_pos + torch.arange(3)
        allowed = torch.cat(
            [valid.bool()[:, None, None].expand(-1, 1, 3, -1), torch.ones(2, 1, 3, 3).tril().bool()], -1
        )
        keys = torch.cat([slot_positions(valid), draft_pos], -1)
        model(
            drafts,
            attention_mask=windowed_masks(allowed, keys, draft_pos, windows)
            if attn == "sdpa"
            else _eager(windowed_masks(allowed, keys, draft_pos, windows)),
            position_ids=draft_pos,
            past_key_values=cache,
            use_cache=True,
        )
        valid = torch.cat([valid, torch.zeros(2, 3, dtype=torch.long)], -1)  # holes
        real = torch.stack([tokens[r, prefix : prefix + block] for r in range(2)])
        real_pos = next_pos + torch.arange(block)
        allowed = torch.cat(
            [
                valid.bool()[:, None, None].expand(-1, 1, block, -1),
                torch.ones(2, 1, block, block).tril().bool(),
            ],
            -1,
        )
        keys = torch.cat([slot_positions(valid), real_pos], -1)
        masks = windowed_masks(allowed, keys, real_pos, windows)
        out = model(
            real,
            attention_mask=masks if attn == "sdpa" else _eager(masks),
            position_ids=real_pos,
            past_key_values=cache,
            use_cache=True,
        ).logits
    for row in range(2):
        torch.testing.assert_close(out[row], reference[row], rtol=1e-4, atol=1e-4)


def test_a_window_by_slot_would_differ():
    """The case above is one the window by slot gets wrong: without the position rule (every layer full) the
    logits after the holes differ, so the test above checks the window, not only the holes."""
    model = sliding_target("mistral", "sdpa")
    torch.manual_seed(1)
    tokens = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        windowed = model(tokens).logits[0, -4:]
        model.config.sliding_window = None
        model.model.config.sliding_window = None
        unwindowed = model(tokens).logits[0, -4:]
    assert not torch.allclose(windowed, unwindowed, atol=1e-4)


def _eager(masks):
    """Eager attention takes its mask additive: the model's own conversion (`custom_attention_mask`)."""
    convert = lambda m: custom_attention_mask(m, "eager", torch.float32)  # noqa: E731
    return {k: convert(m) for k, m in masks.items()} if isinstance(masks, dict) else convert(masks)
