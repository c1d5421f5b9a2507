"""The packed grouped-query SDPA of verify passes (`peagle.generation.attention`): the same attention as
transformers' SDPA, without copying the cache per query head, installed for a block and removed after it."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from helpers import make_target
from peagle.generation.attention import PACKED_SDPA, packed_attention, packing_pays, takes_packed_attention


def verify_logits(target, mask_kind: str) -> torch.Tensor:
    """Logits of a 5-token block after a 12-token prefill, with a hole and left padding in the 4D mask."""
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.long)
    valid[1, :3] = 0
    cache = DynamicCache(config=target.config)
    positions = ((valid.cumsum(-1) - 1) * valid).clamp(min=0)
    with torch.no_grad():
        target(ids, attention_mask=valid, position_ids=positions, past_key_values=cache, use_cache=True)
        valid[0, 7] = 0  # a hole
        block = torch.randint(3, 100, (2, 5))
        pos = ((valid.cumsum(-1) - 1) * valid).max(-1).values[:, None] + 1 + torch.arange(5)
        allowed = torch.cat(
            [
                valid.bool()[:, None, None].expand(-1, 1, 5, -1),
                torch.ones(5, 5).tril().bool()[None, None].expand(2, 1, 5, 5),
            ],
            -1,
        )
        mask = allowed if mask_kind == "bool" else torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        return target(block, attention_mask=mask, position_ids=pos, past_key_values=cache).logits


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_packed_attention_equals_sdpa_without_copying_the_cache(monkeypatch, mask_kind):
    target = make_target(num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa").eval()
    reference = verify_logits(target, mask_kind)

    def no_copies(*args, **kwargs):
        raise AssertionError("repeat_kv copied the cache")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copies)
    with packed_attention(target) as packed:
        assert packed and target.config._attn_implementation == PACKED_SDPA
        torch.testing.assert_close(verify_logits(target, mask_kind), reference, rtol=1e-5, atol=1e-5)
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(AssertionError, match="repeat_kv"):  # without it, SDPA copies: the patch above is live
        verify_logits(target, mask_kind)


def test_packed_attention_only_where_it_serves():
    assert not takes_packed_attention(
        make_target(num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    )
    eager = make_target(num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    assert not takes_packed_attention(eager)
    with packed_attention(eager) as packed:
        assert not packed and eager.config._attn_implementation == "eager"


def test_packed_attention_restores_the_target_after_an_error():
    target = make_target(num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with pytest.raises(RuntimeError, match="boom"), packed_attention(target):
        raise RuntimeError("boom")
    assert target.config._attn_implementation == "sdpa"


def test_packing_pays_for_a_verify_pass_not_for_a_long_prefill():
    # SmolLM2-135M's shape: 9 query heads on 3 key/value heads of 64, fp32 keys, a boolean mask
    key = torch.zeros(1, 3, 1, 64)
    for queries, packs in ((33, True), (1535, True), (1536, False), (2048, False)):
        query, mask = torch.zeros(1, 9, queries, 64), torch.ones(1, 1, queries, 1, dtype=torch.bool)
        assert packing_pays(query, key, mask, 3) is packs
    float_mask = torch.zeros(1, 1, 512, 1)  # four bytes an entry: packs up to 383 queries
    assert not packing_pays(torch.zeros(1, 9, 512, 64), key, float_mask, 3)


def test_a_long_padded_prefill_runs_sdpas_own_path(monkeypatch):
    target = make_target(num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa").eval()
    head_dim = target.config.hidden_size // target.config.num_attention_heads
    # a mask tile of 2 x length bools, as large as the k/v copies (2 x 4 heads x head_dim x 4 bytes)
    length = 2 * 4 * head_dim * 4 // 2
    ids = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, length, dtype=torch.long)
    valid[1, :3] = 0
    with torch.no_grad():
        reference = target(ids, attention_mask=valid).logits
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or real(*a))
    with packed_attention(target), torch.no_grad():
        packed = target(ids, attention_mask=valid).logits
    assert copies  # not packed: SDPA's own path copied the heads
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)
