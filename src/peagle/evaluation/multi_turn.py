"""Multi-turn chat with a cache passed back every turn (issue #77), behind `benchmarks/bench_multi_turn.py`.

A conversation of `turns` user turns, each answered by greedy `target.generate(ids, cache=cache, ...)` where `ids` is
the whole conversation so far and `cache` the one object the previous turn filled: the way transformers documents
continuing a chat.  Some turns open with a long document (RAG), so the conversation grows to several thousand
tokens, and each turn's prompt after the cache is a document or a question.  Two sides run it turn by turn,
interleaved: plain `generate()` with its cache, and the same calls with `assistant_model=head`.  Both sides build
each turn's input from their own previous output (the token sequence, then the turn's closing and the next user
turn), so a side that differed would diverge; every turn's output is compared with plain's and a mismatch reported.

The turn text is ChatML (`<|im_start|>role\\n...<|im_end|>\\n`, SmolLM2's template), appended as tokens after the
previous output, never re-rendered, so the cache's tokens are always a prefix of the next input.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class Turn:
    """One user turn: a question, after a document when `document` is not empty."""

    question: str
    document: str = ""

    def text(self) -> str:
        return f"{self.document}\n\n{self.question}" if self.document else self.question


def conversation_turns(
    questions: Sequence[str], documents: Sequence[str], turns: int, document_every: int = 2
) -> list[Turn]:
    """`turns` turns: turn i asks `questions[i]`, and turns 0, `document_every`, ... open with the next document."""
    if len(questions) < turns:
        raise ValueError(f"{turns} turns need {turns} questions; got {len(questions)}.")
    out, docs = [], iter(documents)
    for i in range(turns):
        doc = next(docs, "") if i % document_every == 0 else ""
        out.append(Turn(questions[i], doc))
    return out


def _encode(tokenizer, text: str) -> torch.LongTensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def turn_input(
    tokenizer, previous: torch.LongTensor | None, turn: Turn, system: str | None = None
) -> torch.LongTensor:
    """`(1, L)` the next turn's input: the previous output (closing its answer when it did not end with
    `<|im_end|>`), then the user turn and the assistant header; the first turn starts with the system prompt."""
    user = f"<|im_start|>user\n{turn.text()}<|im_end|>\n<|im_start|>assistant\n"
    if previous is None:
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return _encode(tokenizer, head + user)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closing = "\n" if int(previous[0, -1]) == end else "<|im_end|>\n"
    return torch.cat([previous, _encode(tokenizer, closing + user)], dim=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_conversation(
    target,
    tokenizer,
    head,
    turns: Sequence[Turn],
    max_new_tokens: int,
    system: str | None = None,
    generate_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run `turns` on both sides, interleaved turn by turn; one record per turn.

    Returns:
        Per turn: `input_tokens`, `cached_tokens` (what the cache held before the turn), `new_tokens`,
        `plain_seconds`, `peagle_seconds`, `speedup` (plain / peagle), `identical` (outputs equal),
        `tokens_per_target_pass`, `catch_up_tokens`, `catch_up_seconds` (the head's catch-up, 0 when the cache
        carried its state), `cost_timing_seconds` (the cost rule's timing inside the turn), `drafter_seconds`.
    """
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, **(generate_kwargs or {}))
    device = target.device
    caches = {"plain": DynamicCache(config=target.config), "peagle": DynamicCache(config=target.config)}
    outputs: dict[str, torch.LongTensor | None] = {"plain": None, "peagle": None}
    records = []
    for i, turn in enumerate(turns):
        record: dict[str, Any] = {"turn": i + 1, "document": bool(turn.document)}
        for side in ("plain", "peagle"):
            ids = turn_input(tokenizer, outputs[side], turn, system).to(device)
            extra = {"assistant_model": head} if side == "peagle" else {}
            cached = caches[side].get_seq_length()
            _sync(device)
            tic = time.perf_counter()
            out = target.generate(ids, cache=caches[side], **kwargs, **extra)
            _sync(device)
            record[f"{side}_seconds"] = time.perf_counter() - tic
            outputs[side] = out
            if side == "plain":
                record.update(
                    input_tokens=ids.shape[1], cached_tokens=cached, new_tokens=out.shape[1] - ids.shape[1]
                )
        stats = head.last_generation_stats
        record.update(
            speedup=record["plain_seconds"] / record["peagle_seconds"],
            identical=bool(torch.equal(outputs["plain"], outputs["peagle"])),
            tokens_per_target_pass=stats.tokens_per_target_pass,
            catch_up_tokens=stats.catch_up_tokens,
            catch_up_seconds=stats.catch_up_seconds,
            cost_timing_seconds=stats.cost_timing_seconds,
            drafter_seconds=stats.drafter_seconds,
        )
        records.append(record)
        if not record["identical"]:  # the sides' next inputs would differ: stop this conversation here
            break
    return records


def summarize(conversations: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Totals over every turn: `speedup` = plain seconds / peagle seconds, the slowest turn, the catch-up share."""
    turns = [t for c in conversations for t in c]
    plain = sum(t["plain_seconds"] for t in turns)
    spec = sum(t["peagle_seconds"] for t in turns)
    return {
        "turns": len(turns),
        "plain_seconds": plain,
        "peagle_seconds": spec,
        "speedup": plain / spec if spec else None,
        "slowest_turn_speedup": min((t["speedup"] for t in turns), default=None),
        "all_identical": all(t["identical"] for t in turns),
        "catch_up_share": max((t["catch_up_seconds"] / t["peagle_seconds"] for t in turns), default=0.0),
        "final_context_tokens": [c[-1]["input_tokens"] + c[-1]["new_tokens"] for c in conversations if c],
        "per_turn_speedup": [
            _mean([c[i]["speedup"] for c in conversations if len(c) > i])
            for i in range(max((len(c) for c in conversations), default=0))
        ],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def format_table(conversations: list[list[dict[str, Any]]], summary: dict[str, Any]) -> str:
    lines = [
        "conv | turn | doc | cached | input | new | plain s | peagle s | speedup | tok/pass | catch-up s | same",
        "-----|------|-----|--------|-------|-----|---------|----------|---------|----------|------------|-----",
    ]
    for c, conv in enumerate(conversations):
        for t in conv:
            lines.append(
                f"{c + 1:4d} | {t['turn']:4d} | {'yes' if t['document'] else 'no':3s} | {t['cached_tokens']:6d} | "
                f"{t['input_tokens']:5d} | {t['new_tokens']:3d} | {t['plain_seconds']:7.2f} | "
                f"{t['peagle_seconds']:8.2f} | {t['speedup']:6.2f}x | {t['tokens_per_target_pass']:8.2f} | "
                f"{t['catch_up_seconds']:10.3f} | {'yes' if t['identical'] else 'NO'}"
            )
    lines.append(
        f"overall: {summary['speedup']:.2f}x ({summary['plain_seconds']:.1f} s plain, {summary['peagle_seconds']:.1f} s "
        f"peagle), slowest turn {summary['slowest_turn_speedup']:.2f}x, all identical: {summary['all_identical']}"
    )
    return "\n".join(lines)


def plot(conversations: list[list[dict[str, Any]]], path: str | Path) -> Path:
    """Seconds per turn, plain against peagle, one panel per conversation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(conversations), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    for c, (ax, conv) in enumerate(zip(axes[0], conversations)):
        x = [t["turn"] for t in conv]
        width = 0.38
        ax.bar(
            [i - width / 2 for i in x], [t["plain_seconds"] for t in conv], width, label="plain generate()"
        )
        ax.bar([i + width / 2 for i in x], [t["peagle_seconds"] for t in conv], width, label="peagle")
        for t in conv:
            ax.annotate(f"{t['speedup']:.2f}x", (t["turn"], max(t["plain_seconds"], t["peagle_seconds"])),
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xlabel(
            f"turn (conversation {c + 1}, {conv[-1]['input_tokens'] + conv[-1]['new_tokens']} tokens)"
        )
        ax.set_xticks(x)
    axes[0][0].set_ylabel("seconds per turn (cache passed back)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = [
    "Turn",
    "conversation_turns",
    "format_table",
    "plot",
    "run_conversation",
    "summarize",
    "turn_input",
]
