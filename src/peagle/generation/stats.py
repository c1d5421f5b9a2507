"""The one statistics object of speculative generation, shared by `generate()`, bench, demo and scripts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def context_bucket(context: int) -> int:
    """A context's bucket (statistics, the cost rule's memory): its power of two rounded down, 0 below 512 tokens.

    >>> context_bucket(300), context_bucket(4095), context_bucket(4096)
    (0, 2048, 4096)
    """
    return 0 if context < 512 else 1 << (int(context).bit_length() - 1)


def _add_buckets(
    a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        entry = out.setdefault(k, {name: 0 for name in v})
        for name, value in v.items():
            entry[name] = entry.get(name, 0) + value
    return out


@dataclass
class PEagleGenerationStats:
    """What speculative `generate()` calls with a P-EAGLE head did; one call's is `head.last_generation_stats`.

    A *round* is a target verify pass that checked at least one draft token.  The target's first token (from
    the prompt prefill, before any features exist) and steps without drafts are *plain steps*.  Always
    `generated_tokens == accepted_tokens + rounds + plain_steps`, the number of new tokens.

    Two named metrics, never called "tau" alone:

    - [`tokens_per_target_pass`]: new tokens / target forward passes (prefill included; plain decoding = 1.0).
      What the benchmark reports and what speed follows.
    - [`acceptance_length`]: tokens emitted per *drafting round*, bonus token included (vLLM's and the P-EAGLE
      paper's "acceptance length").

    Stats of several calls merge with `a + b` (or `PEagleGenerationStats.merge(list)`), so a benchmark sums
    counts over prompts before it divides.

    Args:
        drafting_mode: `"parallel"` or `"autoregressive"` (`"mixed"` after merging both).
        num_speculative_tokens: K, the most draft tokens per round.
        rounds: verify passes with drafts, counted per row (a batched pass over B rows counts B).
        draft_tokens: draft tokens proposed over all rounds and rows.
        accepted_tokens: draft tokens kept (greedy: matched; sampling: accepted by the accept/resample rule).
        plain_steps: target steps without drafts, per row (the prefill included).
        generated_tokens: new tokens emitted in total, over all rows (up to each row's end; tokens that a stopping
            criterion other than length and EOS cut after their round was verified still count).
        accepted_per_depth: `[K]` rounds whose draft at depth d (0 = first draft) was kept.
        drafted_per_depth: `[K]` rounds that proposed a draft at depth d.
        drafter_forward_calls: drafter forward passes, each over the whole batch (parallel: one per round;
            autoregressive: up to K).
        confidence_threshold: the `assistant_confidence_threshold` in effect (0.0: every round drafts K tokens).
        truncated_rounds: rounds that verified fewer drafts than allowed there (K, or fewer near `max_length`):
            cut by the confidence threshold or the cost rule, or a logits processor left no admissible draft.
        drafter_seconds: wall time spent drafting (forwards and token selection).
        total_seconds: wall time from the start of decoding to the last verified round.
        calls: `generate()` calls these stats cover.
        draft_policy: how rounds chose their number of drafts: `"cost"` (the cost-aware rule, the default),
            `"threshold"` (a confidence cut) or `"fixed"` (K every round).
        chosen_k_histogram: `[K + 1]` drafter rounds by the number of drafts the cost rule verified (0 = none).
        skipped_drafter_rounds: plain steps where the cost rule did not even run the drafter.
        declined_rounds: drafter rounds whose drafts the cost rule did not verify (k = 0).
        predicted_tokens, realised_tokens: expected vs emitted tokens over the cost rule's drafting rounds.
        predicted_seconds, measured_seconds: predicted vs measured seconds (drafter + verify) of those rounds.
        batch_size: rows decoded together (the most, after merging).
        target_batch_passes: target forward passes over the batch (the prefill included); with one row it
            equals `target_passes`.
        draft_tree_size: the most draft nodes a round could verify (0: chains only).
        tree_rounds: rounds (per row) that verified a draft tree rather than a chain.
        tree_size_histogram: `[N + 1]` drafter rounds by the number of tree nodes verified (0 = none).
        probe_steps: plain steps the cost rule took to measure a plain step's cost (no drafter run).
        cost_timing_seconds: seconds spent timing the cost curve at a longer context than timed before (once
            per machine, target, batch size and context point).
        seconds_by_context: the cost rule's predicted against measured seconds of every target pass after
            the prefill (drafting rounds: drafter + verify; plain steps: the step), per context bucket and
            batch size: `{"B=<rows> L=<bucket>": {"passes", "predicted_seconds", "measured_seconds"}}`, the
            bucket being the context's power of two rounded down (`"0"` below 512 tokens).
        cached_tokens: prompt tokens the call found in the cache passed to it (a conversation's earlier turns, a
            prefilled document), which the target did not run again.
        catch_up_tokens: of those, the tokens the target re-read (on a copy of the cache's view, the cache left
            as it was) to give the head their features, because the cache arrived without the head's state (0 when
            an earlier call with this head left it there; docs/DESIGN.md section 12.2).
        catch_up_seconds: the seconds of that catch-up pass.
    """

    drafting_mode: str = "parallel"
    num_speculative_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0
    generated_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    drafted_per_depth: list[int] = field(default_factory=list)
    drafter_forward_calls: int = 0
    confidence_threshold: float = 0.0
    truncated_rounds: int = 0
    drafter_seconds: float = 0.0
    total_seconds: float = 0.0
    calls: int = 1
    draft_policy: str = "fixed"
    chosen_k_histogram: list[int] = field(default_factory=list)
    skipped_drafter_rounds: int = 0
    declined_rounds: int = 0
    predicted_tokens: float = 0.0
    realised_tokens: int = 0
    predicted_seconds: float = 0.0
    measured_seconds: float = 0.0
    batch_size: int = 1
    target_batch_passes: int = 0
    draft_tree_size: int = 0
    tree_rounds: int = 0
    tree_size_histogram: list[int] = field(default_factory=list)
    probe_steps: int = 0
    cost_timing_seconds: float = 0.0
    seconds_by_context: dict[str, dict[str, float]] = field(default_factory=dict)
    cached_tokens: int = 0
    catch_up_tokens: int = 0
    catch_up_seconds: float = 0.0

    def observe_pass(self, context: int, batch_size: int, predicted: float, measured: float) -> None:
        """Add one target pass's predicted and measured seconds to its context bucket."""
        bucket = context_bucket(context)
        entry = self.seconds_by_context.setdefault(
            f"B={batch_size} L={bucket}", {"passes": 0, "predicted_seconds": 0.0, "measured_seconds": 0.0}
        )
        entry["passes"] += 1
        entry["predicted_seconds"] += float(predicted)
        entry["measured_seconds"] += float(measured)

    # ------------------------------------------------------------------ named metrics
    @property
    def target_passes(self) -> int:
        """Target forward passes: verify rounds plus plain steps (the prefill included)."""
        return self.rounds + self.plain_steps

    @property
    def tokens_per_target_pass(self) -> float:
        """New tokens per target forward pass, prefill included (plain decoding = 1.0); 0.0 without passes."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per drafting round, bonus included (`(accepted + rounds) / rounds`); 0.0 without rounds."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        """Fraction of the rounds drafting depth d whose draft at depth d was kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    METRICS = ("target_passes", "tokens_per_target_pass", "acceptance_length", "acceptance_rate_per_depth")

    # ------------------------------------------------------------------ merging and (de)serialisation
    def __add__(self, other: PEagleGenerationStats) -> PEagleGenerationStats:
        if not isinstance(other, PEagleGenerationStats):
            return NotImplemented
        out = PEagleGenerationStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                setattr(out, f.name, _add_lists(a, b))
            elif isinstance(a, dict):
                setattr(out, f.name, _add_buckets(a, b))
            elif f.name in ("drafting_mode", "draft_policy"):
                setattr(out, f.name, a if a == b else "mixed")
            elif f.name in (
                "num_speculative_tokens",
                "confidence_threshold",
                "batch_size",
                "draft_tree_size",
            ):
                setattr(out, f.name, max(a, b))
            else:
                setattr(out, f.name, a + b)
        return out

    @classmethod
    def merge(cls, stats: list[PEagleGenerationStats]) -> PEagleGenerationStats:
        """The sum of several calls' stats (counts and per-depth lists add up; ratios are recomputed)."""
        if not stats:
            return cls(calls=0)
        total = stats[0]
        for s in stats[1:]:
            total = total + s
        return total

    def to_dict(self) -> dict[str, Any]:
        """All fields plus the named metrics, JSON-ready."""
        out = asdict(self)
        for name in self.METRICS:
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PEagleGenerationStats:
        """Inverse of [`to_dict`] (derived metrics are ignored; unknown keys raise)."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names - set(cls.METRICS)
        if unknown:
            raise ValueError(
                f"unknown generation-stats fields {sorted(unknown)}; expected some of {sorted(names)}."
            )
        return cls(**{k: v for k, v in data.items() if k in names})


__all__ = ["PEagleGenerationStats", "context_bucket"]
