"""Sliding windows by position (`peagle.generation.windows`): the masks reproduce transformers' own window on a
cache whose slots are not positions (holes, left padding), for every sliding-window family of the matrix; the
sliding layers keep about their window through a call (`ragged.KeptWindows`), the output still plain greedy's."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from helpers import Oracle
from peagle.drafting_peagle import custom_attention_mask
from peagle.generation.ragged import COMPACT_MIN_SLOTS, KeptWindows
from peagle.generation.windows import (
    FULL,
    SLIDING,
    LayerWindows,
    WindowLayer,
    full_cache_layers,
    layer_windows,
    slot_positions,
    windowed_masks,
)
from test_families import COMMON, CONFIGS, new_head, prompt

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


# ---------------------------------------------------------------------------------------------- kept slots
def _sliding_slots_per_pass(model):
    """A forward hook recording, per target pass, the most slots any sliding-window layer of the cache holds."""
    seen: list[int] = []

    def hook(module, args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kinds = getattr(model.config, "layer_types", None) or [SLIDING] * len(cache.layers)
        held = [
            layer.keys.shape[-2]
            for layer, kind in zip(cache.layers, kinds)
            if kind == SLIDING and getattr(layer, "keys", None) is not None
        ]
        seen.append(max(held))

    return seen, model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize(
    ("family", "batch", "tree"),
    [
        ("gemma3_text", 1, 0),
        ("gemma3_text", 1, 8),
        ("gemma3_text", 3, 0),
        ("gemma3_text", 3, 8),
        ("mistral", 3, 8),
    ],
)
def test_sliding_layers_keep_their_window_and_output_stays_plain(family, batch, tree):
    """Prompts of up to 30 tokens and 80 new ones (ten windows of 8): every sliding layer holds at most its window,
    the holes a batch leaves until they are gathered out and one verify pass's slots, at every pass of the call,
    while the output equals plain greedy (the oracle drafter is right with a different probability per row, so
    rows keep different numbers and leave holes)."""
    model = sliding_target(family, "eager")
    window = model.config.sliding_window
    head = new_head(model)
    rows = [prompt(40 + i, length=n)[0] for i, n in enumerate([30, 12, 21][:batch])]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    kw = dict(do_sample=False, max_new_tokens=80, min_new_tokens=80, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, **kw)
    singles = [model.generate(r[None], **kw)[0] for r in rows]
    oracle = Oracle(head, singles, p=[0.9, 0.2, 0.6][:batch], seed=11, second=True)
    seen, hook = _sliding_slots_per_pass(model)
    try:
        out = model.generate(ids, attention_mask=mask, assistant_model=head, draft_tree_size=tree, **kw)
    finally:
        oracle.handle.remove()
        hook.remove()
    assert torch.equal(out, ref), f"{family} B={batch} tree={tree}: output differs from plain greedy"
    stats = head.last_generation_stats
    assert stats.accepted_tokens > 0 and (tree == 0 or stats.tree_rounds > 0)
    pass_slots = max(stats.draft_tree_size if tree else head.config.num_speculative_tokens, 1) + 1
    bound = window - 1 + (COMPACT_MIN_SLOTS - 1 if batch > 1 else 0) + pass_slots
    assert seen and max(seen[1:]) <= bound, f"sliding layers held {max(seen[1:])} slots, more than {bound}"
    assert seen[0] <= window - 1  # the prefill keeps what transformers' own sliding layers keep


def test_returned_cache_is_plain_decodings_and_continues_like_it():
    """One sequence: the cache generate() returns holds transformers' own sliding layers with what plain decoding's
    hold, so plain generate() continues from it exactly as it continues from its own."""
    model = sliding_target("gemma3_text", "eager")
    head = new_head(model)
    ids = prompt(3, length=20)
    out = model.generate(
        ids, do_sample=False, max_new_tokens=30, assistant_model=head, return_dict_in_generate=True
    )
    plain = model.generate(ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    for mine, theirs in zip(out.cache.layers, plain.cache.layers):
        assert type(mine) is type(theirs)
        assert mine.get_seq_length() == theirs.get_seq_length()
        if isinstance(mine, DynamicSlidingWindowLayer):
            assert mine.keys.shape == theirs.keys.shape
    more = model.generate(out.sequences, cache=out.cache, do_sample=False, max_new_tokens=12)
    again = model.generate(plain.sequences, cache=plain.cache, do_sample=False, max_new_tokens=12)
    assert torch.equal(more, again)


def test_kept_windows_trim_cuts_expired_slots_and_gathers_holes():
    """`KeptWindows.trim`: slots at positions up to `next - W` expire; leading columns no row needs are cut, and
    once COMPACT_MIN_SLOTS slots are holes or expired, each row's needed slots are gathered to the right."""
    window = 4
    cache = DynamicCache()
    cache.layers = [WindowLayer(window), DynamicLayer()]
    keys = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 1, 6, 1)
    cache.layers[0].update(torch.zeros(2, 1, 5, 1), torch.zeros(2, 1, 5, 1))  # a prefill of 5 slots ...
    cache.layers[0].keys = cache.layers[0].values = keys[
        :, :, :3
    ]  # ... keeps window - 1 = 3 (here: known keys)
    kept = KeptWindows(cache, torch.ones(2, 5, dtype=torch.long))
    assert kept.valid.tolist() == [[1, 1, 1], [1, 1, 1]]
    # a verify pass of 3 slots: row 0 keeps them all (positions 3..5), row 1 one (position 3) and two holes
    cache.layers[0].update(keys[:, :, 3:], keys[:, :, 3:])
    kept.extend(torch.tensor([[1, 1, 1], [1, 0, 0]]))
    kept.trim(cache, torch.tensor([6, 4]))  # row 0 needs positions 3..5, row 1 positions 1..3
    assert kept.valid.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]]
    # each row keeps one slot of the next pass and leaves COMPACT_MIN_SLOTS holes: gathered to the window
    holes = COMPACT_MIN_SLOTS
    cache.layers[0].update(-torch.ones(2, 1, holes + 1, 1), -torch.ones(2, 1, holes + 1, 1))
    kept.extend(torch.cat([torch.ones(2, 1), torch.zeros(2, holes)], 1).long())
    kept.trim(cache, torch.tensor([7, 5]))
    assert kept.valid.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[4, 5, -1], [8, 9, -1]]
    assert cache.layers[1].keys is None  # full-attention layers keep the call's own slot axis
