"""The drafter's KV cache across the rounds of one `generate()` call, for B >= 1 rows ([`DrafterCache`]).

After a verify pass, row b's sequence is x_0..x_{n-1}; the target features f_0..f_{n-2} are known and x_{n-1} is
the bonus token.  The cache holds each row's real slots from earlier rounds, then the previous round's speculative
slots (the same number in every row).  The loop queues each row's new real slots (slot t = embed(x_{t+1}) + fc(f_t)
at position t: the accepted drafts and the bonus, paired with the verify pass's features); rows accept different
numbers of drafts, so a round's block of new real slots is ragged and is left-padded with masked holes.  Each round
crops the speculative slots away, compacts the holes when they pile up, cuts the cache to the drafter's window and
takes the block ([`DrafterCache.next_block`]).  docs/DESIGN.md sections 3.2 and 10.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..modeling_peagle import PEagleDrafter
from .ragged import compact, drop_oldest, worth_compacting


@dataclass(frozen=True)
class SlotBlock:
    """One round's new real slots for every row, each row right-aligned (left-padded with holes).

    Args:
        tokens: `(B, R)` each slot's token.
        features: `(B, R, F)` the target features paired with them.
        starts: per row, the position of the block's first column in each row (padding columns get positions before
            the row's first real slot).
        new_mask: `(B, R)` 0 at the padding columns.
        attention_mask: `(B, cached + R)` the validity of the cache and the block, or None when nothing is
            masked.
    """

    tokens: torch.LongTensor
    features: torch.Tensor
    starts: list[int]
    new_mask: torch.LongTensor
    attention_mask: torch.LongTensor | None

    @property
    def start(self) -> int | torch.LongTensor:
        """The round's start position for [`PEagleDrafter.draft_round`]: an int for one row, else `(B,)`."""
        if self.tokens.shape[0] == 1:
            return self.starts[0]
        return torch.tensor(self.starts, device=self.tokens.device)


class DrafterCache:
    """The drafter's `DynamicCache`, its validity mask (0: left padding or a hole) and each row's real slots not
    yet in it.

    Args:
        head: the drafter.
        batch_size: the rows the call starts with.
        window: the drafter's attention window (None: the whole context).
    """

    def __init__(self, head: PEagleDrafter, batch_size: int, window: int | None):
        self.head, self.window, self.device = head, window, head.device
        self.cache = DynamicCache(config=head.config)
        self.mask = torch.ones(batch_size, 0, dtype=torch.long, device=self.device)
        self.has_holes = False  # whether mask holds a 0 (masked slots must then be passed on)
        # the most valid slots of a row after the last round (while the cache has holes), as a device scalar that
        # the drafting side reads with the round's other figures (`most_valid_read`): whether compaction pays is
        # then decided without a read of its own
        self.most_valid: torch.Tensor | None = None
        self.most_valid_read: int | None = None
        # per row: (chunks of tokens (r,), chunks of features (r, F), position of the first) real slots not yet in
        # the cache: concatenated once per drafting round, not per step (a long prompt's features, held through
        # skipped rounds, would be copied every step)
        self.pending: list[tuple[list[torch.LongTensor], list[torch.Tensor], int] | None] = [
            None
        ] * batch_size
        # then every row's real slots queued together (rows that all kept as many, as in a plain step): chunks of
        # (tokens (B, r), features (B, r, F)) after each row's own chunks, with the position of each row's first
        # when it had none of its own; split into rows only where a row's own slots follow them
        self.shared: list[tuple[torch.LongTensor, torch.Tensor]] = []
        self.shared_starts: list[int] = []
        self.queued = [0] * batch_size  # per row: its real slots queued (own and shared)
        self.speculative_slots = 0  # slots after the real ones (dropped next round)

    def __deepcopy__(self, memo: dict) -> DrafterCache:
        """A copy of the slots that shares the head (a target cache copied for reuse carries this along)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        memo[id(self.head)] = self.head
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    @property
    def rows(self) -> int:
        """Rows still decoding."""
        return len(self.pending)

    def drop_slots_from(self, position: int) -> bool:
        """Drop every row's queued real slots at `position` and after (a row cut short inside its last round);
        False when some such slot is in the cache already (nothing is dropped then)."""
        self._split_shared()
        held = [p for p in self.pending if p is not None]
        if any(start > position for _, _, start in held):
            return False
        for b, entry in enumerate(self.pending):
            if entry is not None:
                keep = position - entry[2]
                self.pending[b] = ([_joined(entry[0])[:keep]], [_joined(entry[1])[:keep]], entry[2])
                self.queued[b] = min(self.queued[b], max(0, keep))
        return True

    @property
    def length(self) -> int:
        """Slots in the cache, holes and speculative slots included."""
        return self.mask.shape[1]

    def add_real_slots(self, row: int, tokens: torch.LongTensor, features: torch.Tensor, start: int) -> None:
        """Queue row `row`'s new real slots: `tokens (r,)` (x_{t+1}), `features (r, 3 * H_t)` (f_t), for the
        positions `start..start + r - 1`, right after the slots queued or cached before."""
        self._split_shared()
        tokens, features = tokens.to(self.device), features.to(self.device)
        held = self.pending[row]
        if held is None:
            self.pending[row] = ([tokens], [features], int(start))
        else:
            held[0].append(tokens)
            held[1].append(features)
        self.queued[row] += tokens.shape[0]

    def add_shared_slots(self, tokens: torch.LongTensor, features: torch.Tensor, starts: list[int]) -> None:
        """Queue `r` new real slots for every row at once: `tokens (B, r)`, `features (B, r, 3 * H_t)`, row b's
        at the positions `starts[b]..starts[b] + r - 1` ([`add_real_slots`] for each row, without a row's
        slicing: a plain step of B rows queues one chunk)."""
        if not self.shared:
            self.shared_starts = [int(s) for s in starts]
        self.shared.append((tokens.to(self.device), features.to(self.device)))
        self.queued = [n + tokens.shape[1] for n in self.queued]

    def _split_shared(self) -> None:
        """The shared chunks as each row's own (a row's own slots follow them, or rows leave the batch)."""
        shared, self.shared = self.shared, []
        for tokens, features in shared:
            for b in range(self.rows):
                held = self.pending[b]
                if held is None:
                    self.pending[b] = ([tokens[b]], [features[b]], self.shared_starts[b])
                else:
                    held[0].append(tokens[b])
                    held[1].append(features[b])

    def pending_slots(self) -> int:
        """The most real slots any row's next round runs over: its queued ones, at most the window (a long
        prompt's older slots are never drafted from, so a windowed catch-up costs W slots, not the prompt)."""
        queued = max(self.queued, default=0)
        return queued if self.window is None else min(queued, self.window)

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices into the current rows; finished rows leave the batch)."""
        self._split_shared()
        self.pending = [self.pending[i] for i in keep]
        self.queued = [self.queued[i] for i in keep]
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        # the last read stays an upper bound for the rows kept: a compaction check then frees no less than it
        # counts, without a read of its own (the next round reads the exact figure along)
        self.most_valid = None

    def next_block(self) -> SlotBlock:
        """Start a round: drop the last round's speculative slots, compact the holes when worth it, and take every
        row's queued real slots as one block, cut to the window."""
        speculative = self.speculative_slots
        if speculative:
            self.cache.crop(-speculative)
            self.mask = self.mask[:, :-speculative]
            self.speculative_slots = 0
        # read with the last round's figures (its speculative slots were valid), else read now
        most = None if self.most_valid_read is None else self.most_valid_read - speculative
        self.most_valid = self.most_valid_read = None
        if self.has_holes and worth_compacting(self.mask, most):
            self.mask = compact(self.cache, self.mask, most)
        tokens, feats, starts, block_mask = self._ragged_block()
        self.pending, self.shared, self.queued = [None] * self.rows, [], [0] * self.rows
        if self.window is not None:
            tokens, feats, starts, block_mask = self._windowed(tokens, feats, starts, block_mask)
        if block_mask is not None:
            self.has_holes = True
        new_mask = block_mask if block_mask is not None else torch.ones_like(tokens)
        mask = torch.cat([self.mask, new_mask], dim=1) if self.has_holes else None
        return SlotBlock(tokens, feats, starts, new_mask, mask)

    def appended(self, block: SlotBlock, speculative: int) -> None:
        """The round ran: the cache now holds the block's slots and `speculative` slots after them."""
        self.mask = torch.cat(
            [self.mask, block.new_mask, block.new_mask.new_ones(self.rows, speculative)], dim=1
        )
        if self.has_holes:
            self.most_valid = self.mask.sum(dim=1).max()
        self.speculative_slots = speculative

    def _ragged_block(
        self,
    ) -> tuple[torch.LongTensor, torch.Tensor, list[int], torch.LongTensor | None]:
        """The queued real slots of every row as one block, each row right-aligned: `(tokens (B, R), features
        (B, R, F), start (B,), mask (B, R) | None)`."""
        if self.shared and all(p is None for p in self.pending):  # every row's slots queued together
            return (
                _joined([t for t, _ in self.shared], dim=1),
                _joined([f for _, f in self.shared], dim=1),
                self.shared_starts,
                None,
            )
        self._split_shared()
        assert all(p is not None for p in self.pending), "every row needs its new real slots before a round"
        pending = [(_joined(t), _joined(f), start) for t, f, start in self.pending]
        lengths = [p[0].shape[0] for p in pending]
        width = max(lengths)
        if all(n == width for n in lengths):
            tokens = torch.stack([p[0] for p in pending])
            feats = torch.stack([p[1] for p in pending])
            return tokens, feats, [p[2] for p in pending], None
        first = pending[0]
        tokens = first[0].new_full((self.rows, width), self.head.config.mask_token_id)
        feats = first[1].new_zeros(self.rows, width, first[1].shape[-1])
        mask = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        starts = []
        for b, (ids, f, start) in enumerate(pending):
            n = ids.shape[0]
            tokens[b, width - n :] = ids
            feats[b, width - n :] = f
            mask[b, width - n :] = 1
            starts.append(start - (width - n))
        return tokens, feats, starts, mask

    def _windowed(
        self,
        tokens: torch.LongTensor,
        feats: torch.Tensor,
        starts: list[int],
        block_mask: torch.LongTensor | None,
    ) -> tuple[torch.LongTensor, torch.Tensor, list[int], torch.LongTensor | None]:
        """The round's block and the cache cut to the window: at most the last W new real slots (a long prompt's
        older ones are never drafted from), and the cached slots before them dropped so the first new slot sees W
        slots in all."""
        window = self.window
        cut = tokens.shape[1] - window
        if cut > 0:
            tokens, feats, starts = tokens[:, cut:], feats[:, cut:], [start + cut for start in starts]
            block_mask = None if block_mask is None else block_mask[:, cut:]
        drop = self.length - max(0, window - tokens.shape[1])
        if drop > 0:
            drop_oldest(self.cache, drop)
            self.mask = self.mask[:, drop:]
        return tokens, feats, starts, block_mask


def _joined(chunks: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)


__all__ = ["DrafterCache", "SlotBlock"]
