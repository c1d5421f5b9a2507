"""Per-row bookkeeping of one decoding call ([`Rows`]): the output buffer, each row's tokens on the host (prompt
lookup reads them), its length and end, which rows are still in the batch and which of them ended but stay (idle
rows, frozen rows of a static cache); and a round's new tokens cut at `max_length` and after EOS
([`cut_at_end`]).  docs/DESIGN.md section 10."""

from __future__ import annotations

import torch


class Rows:
    """Per-row bookkeeping of one `generate()` call: the output buffer, each row's length and end, and which rows
    are still in the batch."""

    def __init__(self, input_ids: torch.LongTensor, max_length: int, pad: int):
        batch, prompt = input_ids.shape
        self.tokens = input_ids.new_full((batch, max_length), pad)
        self.tokens[:, :prompt] = input_ids
        self.host = input_ids.tolist()  # the same tokens on the host, per row (prompt lookup reads them)
        self.lengths = [prompt] * batch  # tokens of each row, prompt padding included (what processors see)
        self.active = list(range(batch))  # original index of each row still in the batch
        self.done: set[int] = set()  # rows that ended (EOS, max_length, max_time)
        self.idle: set[int] = set()  # ended rows kept in the batch (a pass is cheaper so, or a static cache)

    def history(self, row: int) -> torch.LongTensor:
        return self.tokens[row : row + 1, : self.lengths[row]]

    def append(self, row: int, new: torch.LongTensor, host: list[int], ended: bool = False) -> None:
        """Row `row`'s new tokens, `host` the same ids on the host."""
        n = new.shape[0]
        self.tokens[row, self.lengths[row] : self.lengths[row] + n] = new
        self.host[row].extend(host[:n])
        self.lengths[row] += n
        if ended:
            self.done.add(row)

    def ended(self, row: int) -> bool:
        return row in self.done

    def cut(self, row: int, length: int, pad: int) -> None:
        """End row `row` at `length` tokens (a stopping criterion stopped it there): later tokens become padding."""
        self.tokens[row, length:] = pad
        del self.host[row][length:]
        self.lengths[row] = length
        self.done.add(row)

    def live(self) -> list[bool]:
        """Per row in the batch: whether it is still decoding (not an ended row kept in the batch)."""
        return [b not in self.idle for b in self.active]


def cut_at_end(
    tokens: torch.LongTensor, host: list[int], budget: int, eos: set[int]
) -> tuple[torch.LongTensor, bool]:
    """A row's emitted tokens (`host`: the same ids, read once for the batch) cut at `max_length` and after its
    first EOS; whether the row ended.  Decided on the host: no read of the tensor."""
    n = min(len(host), budget)
    ended = len(host) >= budget
    for i in range(n):
        if host[i] in eos:
            n, ended = i + 1, True
            break
    return (tokens if n == len(host) else tokens[:n]), ended


__all__ = ["Rows", "cut_at_end"]
