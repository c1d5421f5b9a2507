"""Sampling keyed by position: the draw that picks a row's token at a position does not depend on how the call
got there ([`KeyedSampler`]).

Plain sampling draws from one random stream, one draw per step.  A speculative call draws per verified *block*,
and how many drafts a round verifies is the drafting rule's choice (a cost model, online measurements, trees):
under transformers' accept/resample rule the same seed gives other tokens whenever the rule chooses otherwise.
peagle samples with the Gumbel-max trick instead, with the noise keyed by `(row, position)`:

    token at position t of row b  =  argmax_v ( scores[v] + g_{b,t}[v] ),   g_{b,t} ~ Gumbel(0, 1)^V

where `scores` are the processed logits (temperature, top-k, top-p, ... already applied) and `g_{b,t}` comes from
a generator seeded with `(call seed, b, t)`.  The argmax of logits plus independent Gumbel noise is an exact draw
from `softmax(scores)`, and `g_{b,t}` is independent of everything before position t, so every token is drawn
from the target's own distribution given its prefix: the output distribution is plain sampling's.  The draw is a
function of the prefix and the key alone, so verifying a draft is the greedy rule applied to the noisy scores
(accept a draft iff it equals the target's keyed draw), and the drafter drafts with the same noise
(`argmax(draft scores + g_{b,t})`), which makes its drafts agree with the target's draws as often as the two
distributions allow.  The call seed is one draw from torch's global generator, so `torch.manual_seed(s)` before
a call fixes the tokens, whatever K, the tree size, the batch's other rows or the machine's timings
(docs/DESIGN.md section 12.3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .vocab_ops import vocab_argmax

_MIX_ROW = 0x9E3779B97F4A7C15
_MIX_POSITION = 0xBF58476D1CE4E5B9
_SEED_RANGE = 2**62


class KeyedSampler:
    """Gumbel-max draws keyed by `(row, position)` for one `generate()` call.

    Args:
        seed: the call's seed (see [`from_global_generator`]).
        device: where the noise is used (it is drawn on the CPU, so a seed gives the same tokens on any device).
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.seed = int(seed) % _SEED_RANGE
        self.device = torch.device(device)
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_global_generator(cls, device: torch.device | str = "cpu") -> KeyedSampler:
        """A sampler whose seed is one draw from torch's default generator (what `torch.manual_seed` sets)."""
        return cls(int(torch.randint(0, _SEED_RANGE, (1,))), device)

    def _key(self, row: int, position: int) -> int:
        return (self.seed + _MIX_ROW * (int(row) + 1) + _MIX_POSITION * (int(position) + 1)) % _SEED_RANGE

    def noise(self, row: int, position: int, vocab: int) -> torch.Tensor:
        """`(vocab,)` float32 Gumbel(0, 1) noise for token `position` of row `row` (the same on every call)."""
        held = self._noise.get((row, position))
        if held is None or held.shape[0] != vocab:
            generator = torch.Generator().manual_seed(self._key(row, position))
            uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
            uniform = uniform.clamp_(min=torch.finfo(torch.float64).tiny, max=1.0 - 2**-53)
            held = (-torch.log(-torch.log(uniform))).to(self.device, torch.float32)
            self._noise[(row, position)] = held
        return held

    def sample(self, scores: torch.Tensor, rows: Sequence[int], positions: Sequence[int]) -> torch.LongTensor:
        """One draw per row of `scores (N, V)` (processed logits; -inf excluded): row i's token at
        `positions[i]` of original row `rows[i]`.  Returns `(N,)`."""
        vocab = scores.shape[-1]
        keys = list(zip(rows, positions))
        distinct = list(dict.fromkeys(keys))  # a tree's slots at one depth share their position's noise
        noise = torch.stack([self.noise(r, p, vocab) for r, p in distinct]).to(scores.device)
        if len(distinct) < len(keys):
            where = {key: i for i, key in enumerate(distinct)}
            noise = noise[torch.tensor([where[key] for key in keys], device=noise.device)]
        return vocab_argmax(scores.float() + noise)

    def forget_before(self, row: int, position: int) -> None:
        """Drop the noise held for row `row` before `position` (those tokens are decided)."""
        for key in [k for k in self._noise if k[0] == row and k[1] < position]:
            del self._noise[key]


__all__ = ["KeyedSampler"]
