"""What a speculative call returns besides its tokens, step by step as plain `generate()` returns it: which of them
the call asked for (`wanted_outputs`), a verify pass's entries at each row's accepted path (`gather_slots`), scores
and logits per emitted token (`per_step`) and hidden states per step (`hidden_per_step`), from the per-row records
the decoding loop keeps ([`decoding`])."""

from __future__ import annotations

from typing import Any

import torch


def wanted_outputs(generation_config: Any) -> dict[str, bool]:
    """Which per-step outputs the call returns (scores, logits, hidden states)."""
    want_dict = bool(generation_config.return_dict_in_generate)
    return {
        "scores": want_dict and bool(generation_config.output_scores),
        "logits": want_dict and bool(generation_config.output_logits),
        "hidden": want_dict and bool(generation_config.output_hidden_states),
    }


def gather_slots(x: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`x (B, S, ...)` at `index (B, L)` along the slot axis."""
    shape = index.shape + x.shape[2:]
    return x.gather(1, index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(shape))


def per_step(rows: list[list[torch.Tensor]], pad_id: int, fill: float) -> tuple[torch.Tensor, ...]:
    """Per-row lists of `(V,)` tensors -> one `(B, V)` tensor per step; a row past its end reads `fill`
    everywhere but 0 at `pad_token_id`."""
    steps = max(len(r) for r in rows)
    ref = next(t for r in rows for t in r)
    out = []
    for s in range(steps):
        column = []
        for r in rows:
            if s < len(r):
                column.append(r[s])
            else:
                ended = torch.full_like(ref, fill)
                ended[pad_id] = 0.0
                column.append(ended)
        out.append(torch.stack(column))
    return tuple(out)


def hidden_entries_upto(entries: list[Any], steps: int) -> list[Any]:
    """A row's hidden-state records (`(states, row, kept, first)` per record) cut to its first `steps` tokens."""
    out, total = [], 0
    for states, j, kept, first in entries:
        if total >= steps:
            break
        take = min(kept, steps - total)
        out.append((states, j, take, first))
        total += take
    return out


def hidden_per_step(rows: list[list[Any]]) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Hidden states per emitted step, as plain `generate()` returns them: the prefill's states over the prompt,
    then one `(B, 1, H)` per layer per new token (zeros for rows past their end)."""
    per_row_steps: list[list[tuple[torch.Tensor, ...]]] = []
    for entries in rows:
        steps = []
        for states, j, kept, first in entries:
            if first:
                steps.append(tuple(s[j : j + 1] for s in states))
                rest = range(1, kept)
            else:
                rest = range(kept)
            for i in rest:
                steps.append(tuple(s[j : j + 1, i : i + 1] for s in states))
        per_row_steps.append(steps)
    count = max(len(s) for s in per_row_steps)
    out = []
    for step in range(count):
        layers = []
        ref = next(s[step] for s in per_row_steps if len(s) > step)
        for layer in range(len(ref)):
            parts = [s[step][layer] if len(s) > step else torch.zeros_like(ref[layer]) for s in per_row_steps]
            layers.append(torch.cat(parts, dim=0))
        out.append(tuple(layers))
    return tuple(out)


__all__ = ["gather_slots", "hidden_entries_upto", "hidden_per_step", "per_step", "wanted_outputs"]
