"""One drafting round of a P-EAGLE (or EAGLE-3-style) head: the slots it adds, its one parallel pass (or its
autoregressive steps) and the drafts it selects, as the methods `PEagleDrafting` gives `PEagleDrafter`; plus the
outputs and masks the round and the model share.

It ships with `modeling_peagle.py` as Hub remote code (transformers copies a model file's relative imports with it),
so it imports nothing from peagle. docs/DESIGN.md section 3 describes the round.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.utils import ModelOutput
from transformers.utils.deprecation import deprecate_kwarg

CACHE_RENAMED = "cache" in inspect.signature(create_causal_mask).parameters
"""Whether the installed transformers calls the KV cache `cache` (5.24 and later) or `past_key_values`: in forward
arguments (where the old name still works, with a deprecation warning), `ModelOutput` fields and generate()'s model
kwargs. peagle's own API says `cache` on every supported release."""


CACHE_KWARG = "cache" if CACHE_RENAMED else "past_key_values"
"""The installed transformers' name for the KV cache argument, output field and generate() model kwarg."""


def cache_kwarg(cache: Cache | None) -> dict[str, Cache | None]:
    """`{name: cache}` under the installed transformers' name, for calls into its modules and models."""
    return {CACHE_KWARG: cache}


class _CacheOutput(ModelOutput):
    """Base of peagle's outputs that carry a drafter cache in the field `cache`: on transformers before 5.24 it is
    also readable as `past_key_values` (5.24's `ModelOutput` has that alias itself)."""

    if not CACHE_RENAMED:

        @property
        def past_key_values(self) -> Cache | None:
            return self.cache


@dataclass
class PEagleDraft(_CacheOutput):
    """The drafts of one round (see [`PEagleDrafter.draft_round`]).

    Args:
        tokens: `(batch, k)` draft tokens as *target* vocabulary ids, k <= K.
        logits: `(batch, k, draft_vocab_size)` the drafter's logits at the k drafting slots.
        scores: `(batch, k, ...)` what the round's selector returned per depth (in `generate()`: the processed
            target-vocabulary logits each draft was drawn from), or None.
        cache: the drafter cache, holding the context slots, the new real slots and `speculative_slots`
            speculative slots after them (also readable as `past_key_values`).
        speculative_slots: slots after the real ones in the cache (parallel: K-1; autoregressive: one per
            draft after the first); drop them before the next round.
        forward_calls: drafter forward passes this round ran (parallel: 1).
    """

    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    cache: Cache | None = None
    speculative_slots: int | None = None
    forward_calls: int | None = None


DraftSelector = Callable[[torch.Tensor, int], "tuple[Any, ...] | None"]
"""`select(logits, depth) -> (token (B,) target ids, scores, stop) | (tokens (B, W), scores, stop, level) | None`:
how a drafting round turns one depth's logits into drafts (see [`PEagleDrafter.draft_round`])."""


def custom_attention_mask(
    mask: torch.BoolTensor, implementation: str | None, dtype: torch.dtype
) -> torch.Tensor:
    """A custom 4D boolean mask `(B, 1, Q, KV)` (True = attend) in the form `implementation` takes it: SDPA takes
    it as is, eager adds it to the scores (0 where True, the dtype's minimum elsewhere).  transformers passes a
    4D mask straight to the attention function, so this conversion is the whole contract (the drafter's
    training mask and a target's draft-tree mask both go through it)."""
    if implementation in (None, "eager"):
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device))
    return mask


def causal_with_holes(mask: torch.Tensor, queries: int) -> torch.BoolTensor:
    """The drafter's `(B, 1, Q, KV)` boolean mask for its last `queries` slots from a 2D validity `mask (B, KV)`:
    each slot sees the valid slots up to itself, and always itself (a padding slot then attends to something, so
    its output stays finite; no valid slot ever sees it).  Built here rather than by transformers' mask functions,
    which read the mask on the host to see whether it masks anything (a stall per drafting round on a GPU)."""
    kv = mask.shape[1]
    cols = torch.arange(kv, device=mask.device)
    rows = cols[kv - queries :, None]
    causal = cols[None, :] <= rows  # (Q, KV)
    return ((mask.bool()[:, None, :] & causal[None]) | (cols[None, :] == rows)[None])[:, None]


def _block_positions(
    start: int | torch.LongTensor, bsz: int, length: int, device: torch.device
) -> torch.LongTensor:
    """`(B, length)` RoPE positions of a block of slots starting at `start` (an int, or `(B,)` per row)."""
    steps = torch.arange(length, device=device)
    if isinstance(start, torch.Tensor):
        return start.to(device).reshape(-1, 1) + steps
    return (steps + int(start)).unsqueeze(0).expand(bsz, -1)


class PEagleDrafting:
    """The drafting round of [`PEagleDrafter`] (a mixin: it calls the model's `forward`, `mask_vector`, `config`)."""

    def parallel_slots(
        self,
        input_ids: torch.LongTensor,
        start_position: int | torch.LongTensor,
        num_speculative_tokens: int,
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.BoolTensor]:
        """Append K-1 parallel slots to a block of real slots.

        Args:
            input_ids: `(B, R)` tokens of the R new real slots (the last one is the bonus token).
            start_position: RoPE position of the first real slot: an int, or `(B,)` one per row.
            num_speculative_tokens: K.

        Returns:
            `(ids, position_ids, parallel_mask)`, each `(B, R + K - 1)`: ids with `mask_token_id` in the
            parallel slots, positions `start, start+1, ...`, and True at the parallel slots.
        """
        bsz, real = input_ids.shape
        extra = num_speculative_tokens - 1
        fill = input_ids.new_full((bsz, extra), self.config.mask_token_id)
        ids = torch.cat([input_ids, fill], dim=1)
        par = torch.zeros_like(ids, dtype=torch.bool)
        par[:, real:] = True
        return ids, _block_positions(start_position, bsz, real + extra, input_ids.device), par

    def _first_pass(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        k: int,
        cache: Cache,
        start_position: int | torch.LongTensor,
        attention_mask: torch.Tensor | None,
    ) -> tuple[ModelOutput, torch.LongTensor, torch.Tensor | None]:
        """A round's first forward: the new real slots (plus the K-1 parallel slots of a parallel head).
        Returns the output, the slots' positions and the 2D mask so far (None when nothing is masked)."""
        parallel = self.config.drafting_mode != "autoregressive"
        if parallel:
            ids, positions, par = self.parallel_slots(input_ids, start_position, k)
            feats = target_hidden_states
            if k > 1:
                pad = feats.new_zeros(feats.shape[0], k - 1, feats.shape[-1])
                feats = torch.cat([feats, pad], dim=1)
            keep = k
        else:
            ids, feats = input_ids, target_hidden_states
            positions = _block_positions(start_position, ids.shape[0], ids.shape[1], ids.device)
            par = torch.zeros_like(ids, dtype=torch.bool)
            keep = 1
        mask = attention_mask
        if mask is not None and ids.shape[1] > input_ids.shape[1]:  # the parallel slots are valid
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - input_ids.shape[1])], dim=1)
        out = self(
            input_ids=ids,
            target_hidden_states=feats,
            position_ids=positions,
            cache=cache,
            attention_mask=None if mask is None else causal_with_holes(mask, ids.shape[1]),
            parallel_mask=par,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out, positions, mask

    @torch.no_grad()
    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    def draft_round(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        num_speculative_tokens: int,
        cache: Cache,
        start_position: int | torch.LongTensor,
        select: DraftSelector,
        attention_mask: torch.Tensor | None = None,
    ) -> PEagleDraft:
        """THE drafting round (docs/DESIGN.md section 3): the one implementation `draft()`, the `generate()`
        candidate generator and the evaluation code call.

        Appends the R new real slots to the drafter cache and proposes up to K drafts:

        - `drafting_mode="parallel"`: ONE forward over the real slots plus K-1 parallel slots; the drafts are
          read from the last K slots (bonus + parallel), depth by depth, through `select`.
        - `drafting_mode="autoregressive"` (EAGLE-3): one forward over the real slots gives depth 0; each
          further depth feeds one slot (token = the previous draft, hidden input = the previous slot's
          `last_hidden_state`, skipping `fc`) and stops as soon as `select` says so.

        Args:
            input_ids: `(B, R)` tokens of the new real slots (accepted drafts, the bonus token last).
            target_hidden_states: `(B, R, 3 * target_hidden_size)` the target features paired with them.
            num_speculative_tokens: K, the most drafts this round may propose.
            cache: the drafter cache holding the earlier real slots and nothing else (the caller crops the
                previous round's `speculative_slots` first).
            start_position: RoPE position of the first new real slot: an int, or `(B,)` one per row (a batch
                whose rows sit at different positions).
            select: `select(logits (B, V_draft) float32, depth) -> (token (B,) target ids, scores, stop)` or
                `None` to propose nothing at this depth; `stop=True` ends the round after this depth.  `scores`
                (anything, e.g. the processed target-vocabulary logits the token was drawn from) are stacked
                into the result when they are tensors.  An autoregressive round may grow a draft *tree* level
                by level instead (EAGLE-2's expansion): the selector then returns `(tokens (B, W), scores, stop,
                level)`, W drafts per row to feed as the next slots, where `level(last_hidden_state)` gives
                their hidden inputs `(B, W, hidden_size)` from the last pass's `last_hidden_state` and their 4D
                boolean attention mask `(B, 1, W, cached + W)`; it gets the next logits as `(B, W, V_draft)`.
                Such picks are the selector's own record (`tokens`, `logits`, `scores` hold chain picks only).
                A parallel round calls `select.whole_round(logits (B, K, V_draft)) -> tokens (B, K)` instead, once,
                where the selector has one (no depth's pick depends on an earlier one's).
            attention_mask: `None` (every cached and new slot is valid), or a 2D `(B, cached + R)` mask, 0 at
                slots a row must not see (left padding of a ragged block, holes of rejected drafts); the
                round's parallel and autoregressive slots are appended as valid.

        Returns:
            [`PEagleDraft`]: `tokens (B, k)` with k <= K, `logits (B, k, V_draft)`, `scores (B, k, ...)` when the
            selector returned tensors, the cache, `speculative_slots` (slots after the real ones now in the
            cache: drop them before the next round) and `forward_calls`.
        """
        k = int(num_speculative_tokens)
        if k < 1:
            raise ValueError(f"num_speculative_tokens is {k}; expected >= 1.")
        parallel = self.config.drafting_mode != "autoregressive"
        out, positions, mask = self._first_pass(
            input_ids, target_hidden_states, k, cache, start_position, attention_mask
        )
        whole = getattr(select, "whole_round", None) if parallel else None
        if whole is not None:  # a parallel head's depths, picked at once
            block = out.logits[:, :k].float()
            return PEagleDraft(
                tokens=whole(block), logits=block, cache=cache, speculative_slots=k - 1, forward_calls=1
            )
        device = input_ids.device
        calls, speculative = 1, (k - 1 if parallel else 0)
        tokens: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        scores: list[Any] = []
        position = (
            positions[:, input_ids.shape[1] - 1 : input_ids.shape[1]] + 1
        )  # of the next autoregressive slot
        levels = False  # whether the selector feeds levels of several drafts per row (a tree)
        for depth in range(k):
            if parallel or not levels:
                row = (out.logits[:, depth] if parallel else out.logits[:, -1]).float()
            else:
                row = out.logits.float()
            picked = select(row, depth)
            if picked is None:
                break
            token, score, stop = picked[:3]
            if len(picked) == 3:
                tokens.append(token)
                logits.append(row)
                scores.append(score)
            if stop or depth == k - 1:
                break
            if parallel:
                continue
            if len(picked) == 3:  # the next slot: the draft just picked, fed the last slot's hidden state
                slot, hidden = token[:, None].to(device), out.last_hidden_state[:, -1:]
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                slot_mask = None if mask is None else causal_with_holes(mask, 1)
            else:  # a tree's level: the selector says what each slot is fed and sees
                slot, levels = token.to(device), True
                hidden, slot_mask = picked[3](out.last_hidden_state)
            out = self(
                input_ids=slot,
                projected_hidden_states=hidden,
                position_ids=position.expand(-1, slot.shape[1]).clone(),
                cache=cache,
                attention_mask=slot_mask,
                parallel_mask=torch.zeros_like(slot, dtype=torch.bool),
                use_cache=True,
                logits_to_keep=0 if levels else 1,
            )
            position += 1
            calls += 1
            speculative += slot.shape[1]
        bsz = input_ids.shape[0]
        stacked_scores = (
            torch.stack(scores, dim=1) if scores and isinstance(scores[0], torch.Tensor) else None
        )
        return PEagleDraft(
            tokens=torch.stack(tokens, dim=1) if tokens else input_ids.new_zeros(bsz, 0),
            logits=torch.stack(logits, dim=1)
            if logits
            else out.logits.new_zeros(bsz, 0, out.logits.shape[-1]),
            scores=stacked_scores,
            cache=cache,
            speculative_slots=speculative,
            forward_calls=calls,
        )

    @torch.no_grad()
    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    def draft(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        num_speculative_tokens: int | None = None,
        cache: Cache | None = None,
        start_position: int | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
        logits_processor: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> PEagleDraft:
        """K draft tokens for one round, greedy or sampled, through [`draft_round`] (one forward call for a
        parallel head).

        Args:
            input_ids: `(B, R)` the R new real slots' tokens (accepted drafts and the bonus token last).
            target_hidden_states: `(B, R, 3 * target_hidden_size)` the target features paired with them.
            num_speculative_tokens: K (default `config.num_speculative_tokens`).
            cache: the drafter cache holding the earlier context slots (and nothing else); a new cache when
                `None`.
            start_position: RoPE position of the first new slot (default: the cache length).
            do_sample: sample drafts from softmax(logits) instead of argmax.
            generator: the random generator for sampling.
            logits_processor: optional callable `scores -> scores` on each depth's `(B, V_draft)` logits.

        Returns:
            [`PEagleDraft`] with `tokens` `(B, K)` in target ids and the K slots' draft-vocab logits.
        """
        k = num_speculative_tokens or self.config.num_speculative_tokens
        if cache is None:
            cache = DynamicCache(config=self.config)
        if start_position is None:
            start_position = cache.get_seq_length()

        def select(logits: torch.Tensor, depth: int):
            if logits_processor is not None:
                logits = logits_processor(logits)
            if do_sample:
                picked = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
            else:
                picked = logits.argmax(-1)
            return self.draft_to_target(picked), logits, False

        return self.draft_round(input_ids, target_hidden_states, k, cache, start_position, select=select)


__all__ = [
    "CACHE_KWARG",
    "CACHE_RENAMED",
    "DraftSelector",
    "PEagleDraft",
    "PEagleDrafting",
    "cache_kwarg",
    "custom_attention_mask",
]
