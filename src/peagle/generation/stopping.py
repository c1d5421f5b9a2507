"""Stopping criteria evaluated as plain decoding evaluates them, though a round emits several tokens
([`LockstepStops`]).

Plain decoding calls its stopping criteria once per step with the whole batch, `(B, prompt + t)` after step t,
rows that ended padded with `pad_token_id`, and stops a row at the first step a criterion says so.  A speculative
round emits up to K + 1 tokens per row, and rows of a batch advance by different numbers.  peagle replays plain
decoding's calls instead of approximating them: after each round it calls every criterion for each step t that
every unfinished row has reached (the rows ahead wait in the buffer), with exactly the `(B, prompt + t)` tokens
plain decoding would pass, and a row a criterion stops at step t is cut back to t (its tokens after t were never
output, and nothing after them reaches the target's returned cache).  So a criterion sees the same sequence of
calls, inputs and count, as in plain decoding, and stateful criteria (a counter, an agent's parser) behave the
same; `stop_strings` are transformers' own `StopStringCriteria` run this way (docs/DESIGN.md section 12.1).

Length, EOS and time limits stay with the loop, which applies the first two token by token itself (the same
answer without a call per token); only the other criteria are replayed, so a call without them pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

LOOP_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
"""Criteria the loop applies itself: length and EOS token by token per row, a time limit between rounds."""


def replayed_criteria(stopping_criteria: Sequence[Any] | None) -> list[Any]:
    """The criteria [`LockstepStops`] replays: all but [`LOOP_CRITERIA`] (in their order)."""
    return [c for c in (stopping_criteria or []) if not isinstance(c, LOOP_CRITERIA)]


def stop_strings_as_criteria(
    stop_strings: Any, tokenizer: Any, criteria: Sequence[Any] | None
) -> StoppingCriteriaList:
    """transformers' own `StopStringCriteria` for `stop_strings`, first, then the user's `criteria`: what generate()
    builds itself, built before the call because generate() does not hand a `custom_generate` loop the tokenizer
    the criterion needs (it keeps the tokenizer only for its own decoding methods)."""
    if tokenizer is None:
        raise ValueError(
            f"stop_strings={stop_strings!r} need the model's tokenizer: pass `tokenizer=` to generate() as well "
            "(as plain generate() requires)."
        )
    return StoppingCriteriaList(
        [StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings), *(criteria or [])]
    )


class LockstepStops:
    """Replays plain decoding's stopping-criteria calls over the tokens a speculative call emits.

    Args:
        criteria: the criteria to replay ([`replayed_criteria`]).
        batch_size: rows of the call.
        prompt_length: the (left-padded) prompt length; step t's call sees `prompt_length + t` tokens.
        pads_finished_rows: whether a stopped row ends (plain decoding pads a finished row only when the call has
            an EOS criterion; without one a stopped row goes on until every row has stopped).
    """

    def __init__(self, criteria: list[Any], batch_size: int, prompt_length: int, pads_finished_rows: bool):
        self.criteria = criteria
        self.unfinished = [True] * batch_size
        self.checked = prompt_length  # the sequence length of the last replayed call
        self.pads_finished_rows = pads_finished_rows
        self.calls = 0

    def advance(
        self,
        tokens: torch.LongTensor,
        lengths: list[int],
        complete: set[int],
        cut: Callable[[int, int], None],
        step_scores: Callable[[int], Any] | None = None,
    ) -> bool:
        """Replay the calls for every step all rows still decoding have reached.

        Args:
            tokens: `(B, max_length)` the call's buffer (rows past their end hold `pad_token_id`).
            lengths: each row's length so far (prompt included); `cut` updates it.
            complete: rows whose tokens are final (ended by EOS, the length limit, or a criterion); `cut` adds to it.
            cut: `cut(row, length)` ends a row at `length` tokens (padding after), at once, so the next step's call
                sees the padding plain decoding would show it.
            step_scores: `step_scores(length)` -> the `scores` argument plain decoding passes at that length (the
                processed scores so far when the call returns them, else None).

        Returns:
            Whether every row has stopped (the call ends; longer rows were cut at that step).
        """
        while True:
            waiting = [lengths[b] for b in range(len(lengths)) if b not in complete]
            frontier = min(waiting) if waiting else max(lengths)
            if self.checked >= frontier:
                return False
            length = self.checked + 1
            ids = tokens[:, :length]
            scores = step_scores(length) if step_scores is not None else None
            stop = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            for criterion in self.criteria:
                stop = stop | torch.as_tensor(criterion(ids, scores), device=ids.device).bool()
            self.calls += 1
            self.checked = length
            for b, flag in enumerate(stop.tolist()):
                if lengths[b] == length and b in complete:  # the row ended here (EOS or the length limit)
                    self.unfinished[b] = False
                if flag and self.unfinished[b]:
                    self.unfinished[b] = False
                    if self.pads_finished_rows and lengths[b] > length:
                        cut(b, length)
            if not any(self.unfinished):
                for b in range(len(lengths)):
                    if lengths[b] > length:
                        cut(b, length)
                return True


__all__ = ["LOOP_CRITERIA", "LockstepStops", "replayed_criteria", "stop_strings_as_criteria"]
