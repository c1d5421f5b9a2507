"""Long contexts: what a P-EAGLE head does at inference as the context grows (the logic behind
`benchmarks/bench_long_context.py`, whose docstring describes the measurement).

For each context length, the input is whole earlier held-out examples then a held-out prompt
([`peagle.evaluation.long_inputs.build_input`]); the head runs with its default rule (or K every round) against plain
greedy on the same input ([`run_long_context`]), one drafting round and one verify pass are timed against context
([`time_round`]), and the rows are summarised, tabulated and drawn ([`summarize_context`], [`format_table`], [`plot`]).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..configuration_peagle import default_aux_layer_ids
from ..drafting_peagle import cache_kwarg
from ..generation import PEagleGenerationStats
from ..generation.cost import cost_model_for, extend_to_context
from ..generation.settings import AUTO_TREE_NODES
from .long_inputs import build_input, long_inputs
from .results import repeated_ngram_share, save_figure
from .timing import timed_generate

DEFAULT_EXAMPLES = "training_data/smollm2-135m-instruct/heldout"


# ------------------------------------------------------------------------------------------------ inputs
# ------------------------------------------------------------------------------------------------ targets
def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def extended_copy(target, positions: int):
    """A copy of `target` built from a copy of its config with `max_position_embeddings = positions` and the same
    weights (its generation config copied too).  RoPE is computed on the fly, so the copy computes what the target
    would; the positions beyond the original value are past its trained range."""
    cfg = copy.deepcopy(target.config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.max_position_embeddings = int(positions)
    param = next(target.parameters())
    model = type(target)(cfg)
    model.load_state_dict(target.state_dict())
    model.generation_config = copy.deepcopy(target.generation_config)
    return model.to(device=param.device, dtype=param.dtype).eval()


# ------------------------------------------------------------------------------------------------ timing
def _crop_to(cache, length: int) -> None:
    """Drop a cache's slots after the first `length` (transformers crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_round(
    target, head, ids: Sequence[int], k: int, real_slots: int = 3, repeats: int = 5
) -> dict[str, Any]:
    """Milliseconds of one drafting round (R = `real_slots` new real slots + K-1 parallel slots) over a drafter
    cache of the context's other real slots, of one target verify pass of K+1 tokens and of a one-token target step
    over the target's cache of all of `ids`: medians of `repeats` interleaved runs after one warm-up each.  Also
    the first round (the context into the drafter cache, one run) and the target's prefill (one run)."""
    device = next(target.parameters()).device
    dtype = next(head.parameters()).dtype
    tc = text_config(target)
    aux = list(
        head.config.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(int(tc.num_hidden_layers))
    )
    n = len(ids)
    if n - 1 - real_slots < 1:
        raise ValueError(f"input of {n} tokens is too short for a round of {real_slots} real slots")
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    cache = DynamicCache(config=tc)
    _sync(device)
    t0 = time.perf_counter()
    out = target(
        input_ids=x, use_cache=True, output_hidden_states=aux, logits_to_keep=1, **cache_kwarg(cache)
    )
    _sync(device)
    prefill_s = time.perf_counter() - t0
    feats = torch.cat([out.hidden_states[i] for i in aux], dim=-1).to(dtype)
    del out
    # drafter slot t: token x_{t+1} with the target's feature f_t, at position t
    tokens, feats = x[:, 1:], feats[:, :-1]
    cut = n - 1 - real_slots

    def select(logits: torch.Tensor, depth: int):
        return head.draft_to_target(logits.argmax(-1)), None, False

    dcache = DynamicCache(config=head.config)
    _sync(device)
    t0 = time.perf_counter()
    first = head.draft_round(tokens[:, :cut], feats[:, :cut], k, dcache, 0, select=select)
    _sync(device)
    first_s = time.perf_counter() - t0
    _crop_to(dcache, cut)
    del first
    verify_ids = x[:, n - (k + 1) :]
    step_ids = x[:, n - 1 :]

    def draft():
        head.draft_round(tokens[:, cut:], feats[:, cut:], k, dcache, cut, select=select)

    def verify(new):
        target(input_ids=new, use_cache=True, output_hidden_states=aux, **cache_kwarg(cache))

    times: dict[str, list[float]] = {"draft": [], "verify": [], "step": []}
    calls = {
        "draft": (draft, lambda: _crop_to(dcache, cut)),
        "verify": (lambda: verify(verify_ids), lambda: _crop_to(cache, n)),
        "step": (lambda: verify(step_ids), lambda: _crop_to(cache, n)),
    }
    for rep in range(repeats + 1):  # the first run of each warms up
        for name, (fn, reset) in calls.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rep:
                times[name].append(time.perf_counter() - t0)
            reset()
    draft_ms, verify_ms, step_ms = (1e3 * statistics.median(times[m]) for m in ("draft", "verify", "step"))
    return {
        "cache_tokens": n,
        "drafter_cache_slots": cut,
        "real_slots": real_slots,
        "k": k,
        "repeats": repeats,
        "draft_round_ms": draft_ms,
        "verify_ms": verify_ms,
        "target_step_ms": step_ms,
        "draft_verify_ratio": draft_ms / verify_ms if verify_ms else None,
        "first_round_ms": 1e3 * first_s,
        "target_prefill_ms": 1e3 * prefill_s,
        "draft_round_ms_all": [1e3 * t for t in times["draft"]],
        "verify_ms_all": [1e3 * t for t in times["verify"]],
    }


# ------------------------------------------------------------------------------------------------ the benchmark
def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


@dataclass
class LongContextSettings:
    """How every context is measured (the command line's options; see the module docstring): `max_new_tokens` per
    run, the `separator` ids after each earlier example, K every round (`num_assistant_tokens`; None: the head's
    default rule), the round timing's `repeats` and `real_slots` (and whether it runs, `timing`), and the
    `max_position_embeddings` of the target copy used past its trained range (`extend_positions`)."""

    max_new_tokens: int = 64
    separator: Sequence[int] = ()
    num_assistant_tokens: int | None = None
    repeats: int = 5
    real_slots: int = 3
    extend_positions: int = 32768
    timing: bool = True


def run_long_context(
    target,
    head,
    examples: Sequence[dict[str, Any]],
    contexts: Sequence[int],
    prompt_indices: Sequence[int],
    settings: LongContextSettings | None = None,
    log=print,
    inputs: dict[int, list[tuple[list[int], dict[str, Any]]]] | None = None,
) -> dict[str, Any]:
    """Run both measurements at every context (see the module docstring) and return the JSON-ready results:
    `runs` (one per context and prompt), `timing` (one per context), `summary` (one per context) and `config`.
    `inputs`: the inputs per context, one per prompt index ([`peagle.evaluation.long_inputs.long_inputs`]; default:
    earlier examples before each prompt)."""
    settings = settings or LongContextSettings()
    trained = int(text_config(target).max_position_embeddings)
    k = int(settings.num_assistant_tokens or head.config.num_speculative_tokens)
    gen_kwargs: dict[str, Any] = {}
    if settings.num_assistant_tokens:
        gen_kwargs = {
            "num_assistant_tokens": k,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
    device = next(target.parameters()).device
    inputs_at = inputs or long_inputs(examples, contexts, prompt_indices, settings.separator)
    warm = torch.tensor([build_input(examples, prompt_indices[0], 0, settings.separator)[0]], device=device)
    cost_timing = _warm_up(target, head, warm, [(c, inputs_at[c]) for c in contexts], settings, k, gen_kwargs)
    extended = None
    runs: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    log(format_header())
    for context in contexts:
        inputs = inputs_at[context]
        needed = max(len(ids) + settings.max_new_tokens + k + 1 for ids, _ in inputs)
        past = needed > trained
        model, positions, refused = target, trained, None
        if past and needed > settings.extend_positions:
            refused = f"needs {needed} positions; --extend-positions is {settings.extend_positions}"
        elif past:
            if extended is None:
                extended = extended_copy(target, settings.extend_positions)
            model, positions = extended, settings.extend_positions
        rows = []
        for (ids, info), index in zip(inputs, prompt_indices):
            row: dict[str, Any] = {"context": context, **info, "input_tokens": len(ids)}
            x = torch.tensor([ids], device=device)
            try:
                if refused:
                    raise ValueError(refused)
                # plain first for even prompts, the head first for odd ones: neither run always gets the warmer
                # or the colder process (a long prefill's time varies from run to run by a fifth here)
                row.update(_compare(model, head, x, settings.max_new_tokens, gen_kwargs, len(rows) % 2 == 0))
            except Exception as exc:  # noqa: BLE001 - record any failure (e.g. out of memory) as the row's result
                row["error"] = _error(exc)
                log(f"context {context}, prompt {index}: failed: {row['error']}")
            rows.append(row)
        runs += rows
        tim: dict[str, Any] = {"context": context}
        if settings.timing:
            try:
                if refused:
                    raise ValueError(refused)
                tim.update(time_round(model, head, inputs[0][0], k, settings.real_slots, settings.repeats))
            except Exception as exc:  # noqa: BLE001
                tim["error"] = _error(exc)
                log(f"context {context}, round timing: failed: {tim['error']}")
        timings.append(tim)
        entry = summarize_context(context, rows, tim, past, positions, trained)
        summary.append(entry)
        log(format_row(entry))
    config = _run_config(head, contexts, prompt_indices, settings, k, trained)
    return {
        "runs": runs,
        "timing": timings,
        "summary": summary,
        "config": {**config, "cost_timing_seconds": cost_timing},
    }


def _warm_up(
    target,
    head,
    warm: torch.Tensor,
    inputs_at: list[tuple[int, list]],
    settings: LongContextSettings,
    k: int,
    gen_kwargs: dict[str, Any],
) -> dict[str, float]:
    """Warm up outside the measured runs (and calibrate the cost rule once); under the default rule, time the
    curve's context points for every context (`(context, its inputs)`) as a first call at that length would.
    Returns the seconds spent timing per context."""
    timed_generate(target, warm, 4)
    timed_generate(target, warm, 4, assistant=head, **gen_kwargs)
    cost_timing: dict[str, float] = {}
    if not settings.num_assistant_tokens:  # the cost rule's context points, timed once per machine
        curve = cost_model_for(target, head, max(k, AUTO_TREE_NODES) + 1)
        for context, inputs in inputs_at:
            longest = max(len(ids) for ids, _ in inputs)
            cost_timing[str(context)] = extend_to_context(
                curve, target, head, longest + settings.max_new_tokens, len(curve.verify_seconds)
            )
    return cost_timing


def _compare(
    model, head, x: torch.Tensor, max_new_tokens: int, gen_kwargs: dict[str, Any], plain_first: bool
) -> dict[str, Any]:
    """One input decoded plainly and with the head (in the order `plain_first` says): the row's measurements."""
    if plain_first:
        plain = timed_generate(model, x, max_new_tokens)
        run = timed_generate(model, x, max_new_tokens, assistant=head, **gen_kwargs)
    else:
        run = timed_generate(model, x, max_new_tokens, assistant=head, **gen_kwargs)
        plain = timed_generate(model, x, max_new_tokens)
    stats = run.stats
    return dict(
        new_tokens=run.new_tokens,
        plain_new_tokens=plain.new_tokens,
        identical=run.output == plain.output,
        plain_target_passes=plain.target_calls,
        target_passes=run.target_calls,
        tokens_per_target_pass=stats.tokens_per_target_pass if stats else run.tokens_per_target_pass,
        plain_seconds=plain.seconds,
        seconds=run.seconds,
        plain_prefill_seconds=plain.prefill_seconds,
        prefill_seconds=run.prefill_seconds,
        drafter_seconds=run.drafter_seconds,
        stats=stats.to_dict() if stats else None,
        repeated_ngrams=repeated_ngram_share(plain.output),
        output=plain.output,
        **({} if run.output == plain.output else {"head_output": run.output}),
    )


def _run_config(
    head,
    contexts: Sequence[int],
    prompt_indices: Sequence[int],
    settings: LongContextSettings,
    k: int,
    trained: int,
) -> dict[str, Any]:
    """The JSON's `config`: what the run measured with."""
    return {
        "contexts": list(contexts),
        "prompt_examples": list(prompt_indices),
        "max_new_tokens": settings.max_new_tokens,
        "separator": list(settings.separator),
        "drafting_rule": f"K={k} every round" if settings.num_assistant_tokens else "the head's default rule",
        "k": k,
        "real_slots": settings.real_slots,
        "repeats": settings.repeats,
        "target_max_position_embeddings": trained,
        "extended_max_position_embeddings": settings.extend_positions,
        "head_max_position_embeddings": getattr(head.config, "max_position_embeddings", None),
    }


def summarize_context(
    context: int,
    rows: list[dict[str, Any]],
    tim: dict[str, Any],
    past: bool,
    positions: int,
    trained: int,
) -> dict[str, Any]:
    """One context's summary: means over its prompts, the pooled statistics, the round timing."""
    ok = [r for r in rows if "error" not in r]
    stats = [PEagleGenerationStats.from_dict(r["stats"]) for r in ok if r.get("stats")]
    merged = PEagleGenerationStats.merge(stats) if stats else None
    plain_s = sum(r["plain_seconds"] for r in ok)
    head_s = sum(r["seconds"] for r in ok)
    per_prompt = [
        (r["new_tokens"] / r["seconds"]) / (r["plain_new_tokens"] / r["plain_seconds"])
        for r in ok
        if r["seconds"] > 0 and r["plain_seconds"] > 0
    ]
    # after the prefill (which no rule changes and whose run-to-run noise dominates a long prompt's time)
    decode = [
        (r["new_tokens"] / (r["seconds"] - r["prefill_seconds"]))
        / (r["plain_new_tokens"] / (r["plain_seconds"] - r["plain_prefill_seconds"]))
        for r in ok
        if r.get("prefill_seconds") is not None and r["seconds"] > r["prefill_seconds"]
    ]
    buckets = merged.seconds_by_context if merged else {}
    repeats = [r["repeated_ngrams"] for r in ok if r.get("repeated_ngrams") is not None]
    return {
        "context": context,
        "context_tokens_mean": statistics.mean(r["context_tokens"] for r in rows) if rows else 0,
        "input_tokens_max": max((r["input_tokens"] for r in rows), default=0),
        "prompts": len(rows),
        "failed": len(rows) - len(ok),
        "tokens_per_target_pass": statistics.mean(r["tokens_per_target_pass"] for r in ok) if ok else None,
        "tokens_per_target_pass_per_prompt": [r["tokens_per_target_pass"] for r in ok],
        "tokens_per_target_pass_pooled": merged.tokens_per_target_pass if merged else None,
        "acceptance_length": merged.acceptance_length if merged else None,
        "plain_tokens_per_target_pass": (
            sum(r["plain_new_tokens"] for r in ok) / sum(r["plain_target_passes"] for r in ok) if ok else None
        ),
        "identical": all(r["identical"] for r in ok) if ok else None,
        "speedup": (
            (sum(r["new_tokens"] for r in ok) / head_s) / (sum(r["plain_new_tokens"] for r in ok) / plain_s)
            if ok and head_s > 0 and plain_s > 0
            else None
        ),
        "speedup_per_prompt": per_prompt,
        "decode_speedup": (
            (sum(r["new_tokens"] for r in ok) / sum(r["seconds"] - r["prefill_seconds"] for r in ok))
            / (
                sum(r["plain_new_tokens"] for r in ok)
                / sum(r["plain_seconds"] - r["plain_prefill_seconds"] for r in ok)
            )
            if decode
            else None
        ),
        "decode_speedup_per_prompt": decode,
        "slowest_prompt_decode_speedup": min(decode) if decode else None,
        "slowest_prompt_speedup": min(per_prompt) if per_prompt else None,
        "repeated_ngrams": statistics.mean(repeats) if repeats else None,
        "repeated_ngrams_per_prompt": repeats,
        "rule_seconds_by_context": buckets,
        "rule_predicted_over_measured": (
            sum(b["predicted_seconds"] for b in buckets.values())
            / sum(b["measured_seconds"] for b in buckets.values())
            if buckets
            else None
        ),
        "draft_round_ms": tim.get("draft_round_ms"),
        "verify_ms": tim.get("verify_ms"),
        "target_step_ms": tim.get("target_step_ms"),
        "draft_verify_ratio": tim.get("draft_verify_ratio"),
        "first_round_ms": tim.get("first_round_ms"),
        "timing_cache_tokens": tim.get("cache_tokens"),
        "timing_error": tim.get("error"),
        "max_position_embeddings": positions,
        "trained_max_position_embeddings": trained,
        "past_trained_range": past,
        "note": (
            f"target runs past its trained range: max_position_embeddings raised from {trained} to {positions} "
            "(RoPE computed on the fly, weights unchanged)"
            if past
            else None
        ),
    }


# ------------------------------------------------------------------------------------------------ output
def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_header() -> str:
    return (
        f"{'context':>7} {'ctx tok':>7} {'prompts':>7} {'tok/pass':>8} {'acc.len':>7} {'identical':>9} "
        f"{'draft ms':>8} {'verify ms':>9} {'ratio':>6} {'speedup':>7} {'slowest':>7} {'decode':>6} {'slowest':>7} "
        f"{'pred/meas':>9} {'repeat':>6}  range"
    )


def format_row(s: dict[str, Any]) -> str:
    ident = "-" if s["identical"] is None else ("yes" if s["identical"] else "NO")
    failed = f" ({s['failed']} failed)" if s["failed"] else ""
    rng = (
        f"PAST TRAINED {s['trained_max_position_embeddings']} (run at {s['max_position_embeddings']})"
        if s["past_trained_range"]
        else "within trained"
    )
    return (
        f"{s['context']:>7} {s['context_tokens_mean']:>7.0f} {s['prompts']:>7} "
        f"{_num(s['tokens_per_target_pass'], '.2f'):>8} {_num(s['acceptance_length'], '.2f'):>7} {ident:>9} "
        f"{_num(s['draft_round_ms'], '.1f'):>8} {_num(s['verify_ms'], '.1f'):>9} "
        f"{_num(s['draft_verify_ratio'], '.2f'):>6} {_num(s['speedup'], '.2f'):>7} "
        f"{_num(s.get('slowest_prompt_speedup'), '.2f'):>7} {_num(s.get('decode_speedup'), '.2f'):>6} "
        f"{_num(s.get('slowest_prompt_decode_speedup'), '.2f'):>7} {_num(s.get('rule_predicted_over_measured'), '.2f'):>9} "
        f"{_num(s.get('repeated_ngrams'), '.0%'):>6}  {rng}{failed}"
    )


def format_table(summary: list[dict[str, Any]]) -> str:
    return "\n".join([format_header(), *(format_row(s) for s in summary)])


def plot(summary: list[dict[str, Any]], path: str | Path) -> Path:
    """Tokens per target pass against context (left) and the round costs against context (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    fast = [s for s in summary if s.get("speedup") is not None]
    if fast:
        xs = [s["context_tokens_mean"] for s in fast]
        middle.plot(
            xs, [s["speedup"] for s in fast], marker="o", color="C2", label="default rule, all prompts"
        )
        for s in fast:
            per = s.get("speedup_per_prompt") or []
            middle.scatter([s["context_tokens_mean"]] * len(per), per, color="C2", alpha=0.4, s=12)
        after = [s for s in fast if s.get("decode_speedup") is not None]
        if after:
            middle.plot([s["context_tokens_mean"] for s in after], [s["decode_speedup"] for s in after],
                        marker="s", color="C3", label="after the prefill")  # fmt: skip
            for s in after:
                per = s["decode_speedup_per_prompt"]
                middle.scatter([s["context_tokens_mean"]] * len(per), per, color="C3", alpha=0.4, s=12)
    middle.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain greedy")
    middle.set_ylabel("speed against plain greedy (dots: prompts)")
    middle.set_xlabel("context tokens before the prompt (mean over prompts)")
    middle.set_title("speed of the head's rule vs context", fontsize=9)
    middle.grid(alpha=0.3)
    middle.legend(fontsize=8)
    pts = [s for s in summary if s["tokens_per_target_pass"] is not None]
    if pts:
        xs = [s["context_tokens_mean"] for s in pts]
        left.plot(
            xs, [s["tokens_per_target_pass"] for s in pts], marker="o", label="P-EAGLE (mean over prompts)"
        )
        for s in pts:
            per = s["tokens_per_target_pass_per_prompt"]
            left.scatter([s["context_tokens_mean"]] * len(per), per, color="C0", alpha=0.3, s=12)
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain greedy")
    left.set_ylabel("new tokens per target pass")
    timed = [s for s in summary if s["draft_round_ms"] is not None]
    if timed:
        xs = [s["timing_cache_tokens"] for s in timed]
        right.plot(xs, [s["draft_round_ms"] for s in timed], marker="o", label="drafting round")
        right.plot(xs, [s["verify_ms"] for s in timed], marker="s", label="target verify pass (K+1 tokens)")
        right.plot(xs, [s["target_step_ms"] for s in timed], marker="^", label="target step (1 token)")
        for s, x in zip(timed, xs):
            right.annotate(f"{s['draft_verify_ratio']:.2f}", (x, s["draft_round_ms"]), fontsize=7,
                           textcoords="offset points", xytext=(0, 6), ha="center")  # fmt: skip
    right.set_ylabel("ms (median); labels: draft / verify")
    for ax, x_key, y_key in (
        (left, "context_tokens_mean", "tokens_per_target_pass"),
        (right, "timing_cache_tokens", "verify_ms"),
    ):
        past = [s for s in summary if s["past_trained_range"] and s[y_key] is not None]
        if past:
            ax.scatter([s[x_key] for s in past], [s[y_key] for s in past], s=160, facecolors="none",
                       edgecolors="red", label="target past its trained range")  # fmt: skip
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not timed:  # --no-timing: no round costs to draw
        fig.delaxes(right)
    left.set_xlabel("context tokens before the prompt (mean over prompts)")
    right.set_xlabel("cache tokens (first prompt's context + prompt)")
    left.set_title("tokens per target pass vs context", fontsize=9)
    right.set_title("drafting round and verify pass cost vs context", fontsize=9)
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------------------ command line
