"""`peagle demo`: a target with and without a P-EAGLE head (default: the embedded SmolLM2 and the shipped head)."""

from __future__ import annotations

import torch

DEMO_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two short paragraphs.",
)


def run_demo(
    max_new_tokens: int = 128,
    num_speculative_tokens: int | None = None,
    prompts: tuple[str, ...] = DEMO_PROMPTS,
    confidence_threshold: float | None = None,
    dtype: str = "float32",
    head_dtype: str | None = "auto",
    target: str | None = None,
    head: str | None = None,
) -> bool:
    """Generate for a few prompts with plain greedy decoding, with the head's default drafting rule (cost-aware
    unless a cut is given), and with K drafts every round; print equality, tokens/s and speedups side by side.

    `dtype` is the target's; `head_dtype` the drafter's (`"auto"`: bfloat16 where this machine computes it natively,
    else float32, see `peagle.runtime`; None: the target's).  `target` is a folder or Hub id
    (default: the embedded SmolLM2-135M-Instruct) and `head` a head folder in any layout peagle reads (default: the
    shipped head, which only fits the default target).  Returns True when every speculative output equals the
    plain greedy output.
    """
    from .data.evalsets import chat_prompt_tensor
    from .evaluation.timing import timed_generate

    check_demo_settings(num_speculative_tokens, confidence_threshold)
    default_target = target is None or target == "default"
    if not default_target and head is None:
        raise ValueError(
            f"a demo with target {target} needs a head trained for it (`peagle train --target {target} "
            "--output_dir HEAD`, then --head HEAD); the shipped head fits only the embedded SmolLM2 target."
        )
    target_model, tokenizer, head = load_demo_models(target, head, dtype, head_dtype)
    k = num_speculative_tokens or head.config.num_speculative_tokens
    default_kw, fixed_kw = rule_kwargs(head, num_speculative_tokens, confidence_threshold)
    rule = (
        f"confidence cut {confidence_threshold}"
        if confidence_threshold is not None
        else "cost-aware: each round verifies the drafts expected to pay on this machine"
    )
    print(
        f"head: {head.config.num_hidden_layers} layers, draft vocab {head.config.draft_vocab_size}, K={k}; {rule}"
    )
    ids0 = chat_prompt_tensor(tokenizer, prompts[0])
    timed_generate(target_model, ids0, 8)  # warm-up (and, the first time, the cost model's short calibration)
    timed_generate(target_model, ids0, 8, **default_kw)
    totals = {"plain": [0, 0.0], "default": [0, 0.0], "fixed": [0, 0.0]}
    stats, all_equal = [], True
    for text in prompts:
        ids = chat_prompt_tensor(tokenizer, text)
        runs = {
            "plain": timed_generate(target_model, ids, max_new_tokens),
            "default": timed_generate(target_model, ids, max_new_tokens, **default_kw),
            "fixed": timed_generate(target_model, ids, max_new_tokens, **fixed_kw),
        }
        stats.append(runs["default"].stats)
        all_equal &= print_prompt(text, runs, tokenizer, k)
        for name, r in runs.items():
            totals[name][0] += r.new_tokens
            totals[name][1] += r.seconds
    print_totals(totals, stats, all_equal, k, dtype, head.dtype, max_new_tokens)
    return all_equal


def check_demo_settings(num_speculative_tokens: int | None, confidence_threshold: float | None) -> None:
    from .configuration_peagle import MAX_SPECULATIVE_TOKENS

    k = num_speculative_tokens
    if k is not None and (
        isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS
    ):
        raise ValueError(
            f"num_speculative_tokens is {k!r}; expected an integer in [1, {MAX_SPECULATIVE_TOKENS}] or None (the "
            "head's own K)."
        )
    if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
        raise ValueError(
            f"confidence_threshold is {confidence_threshold!r}; expected a probability in [0, 1]."
        )


def load_demo_models(target: str | None, head: str | None, dtype: str, head_dtype: str | None):
    """`(target, tokenizer, head)`: the target (default: the embedded SmolLM2) and the head attached to it."""
    from .modeling_peagle import PEagleDrafter
    from .runtime import resolve_dtype
    from .targets import default_drafter_path, load_default_drafter, load_target

    default_target = target is None or target == "default"
    if head is None:
        default_drafter_path()  # the shipped head's distribution is there, before the target loads (and converts)
    print(
        f"loading the target ({'embedded SmolLM2-135M-Instruct' if default_target else target}) and the head ..."
    )
    target_model, tokenizer = load_target(
        "default" if default_target else target, dtype=getattr(torch, dtype)
    )
    if tokenizer is None:
        raise ValueError(f"the target {target} has no tokenizer; the demo needs one for its prompts.")
    drafter_dtype = resolve_dtype(head_dtype) if head_dtype is not None else target_model.dtype
    if head is None:
        return target_model, tokenizer, load_default_drafter(target_model, dtype=drafter_dtype)
    drafter = PEagleDrafter.from_pretrained(head, dtype=drafter_dtype)
    return target_model, tokenizer, drafter.attach_target(target_model).to(target_model.device).eval()


def rule_kwargs(
    head, num_speculative_tokens: int | None, confidence_threshold: float | None
) -> tuple[dict, dict]:
    """`timed_generate` keywords of the head's default rule (or the K / cut given) and of K drafts every round."""
    k = num_speculative_tokens or head.config.num_speculative_tokens
    default_kw: dict = {"assistant": head}
    if num_speculative_tokens is not None:
        default_kw.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
    if confidence_threshold is not None:
        default_kw["assistant_confidence_threshold"] = confidence_threshold
    fixed_kw = {
        "assistant": head,
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    return default_kw, fixed_kw


def print_prompt(text: str, runs: dict, tokenizer, k: int) -> bool:
    """One prompt's answer and speeds; returns whether both head runs equal plain greedy."""
    plain = runs["plain"]
    equal = all(r.output == plain.output for name, r in runs.items() if name != "plain")
    print("\n" + "=" * 78)
    print(f"user: {text}")
    print("-" * 78)
    print(tokenizer.decode(runs["default"].output, skip_special_tokens=True).strip())
    print("-" * 78)
    tps = {name: r.new_tokens / r.seconds for name, r in runs.items()}
    print(
        f"identical to plain greedy: {equal} | plain {tps['plain']:.1f} tok/s | P-EAGLE default rule "
        f"{tps['default']:.1f} tok/s ({tps['default'] / tps['plain']:.2f}x) | K={k} every round "
        f"{tps['fixed']:.1f} tok/s ({tps['fixed'] / tps['plain']:.2f}x)"
    )
    return equal


def print_totals(
    totals: dict, stats: list, all_equal: bool, k: int, dtype: str, head_dtype, max_new_tokens: int
):
    from .generation.stats import PEagleGenerationStats

    total = PEagleGenerationStats.merge(stats)
    tps = {name: n / s for name, (n, s) in totals.items()}
    print("\n" + "=" * 78)
    print(
        f"TOTAL  outputs identical: {all_equal} | plain {tps['plain']:.1f} tok/s | P-EAGLE default rule "
        f"{tps['default']:.1f} tok/s, speedup {tps['default'] / tps['plain']:.2f}x | K={k} every round "
        f"{tps['fixed']:.1f} tok/s, speedup {tps['fixed'] / tps['plain']:.2f}x"
    )
    chains = ", ".join(f"{j}:{n}" for j, n in enumerate(total.chosen_k_histogram) if n)
    trees = ", ".join(f"{j}:{n}" for j, n in enumerate(total.tree_size_histogram) if n)
    print(
        f"default rule: tokens per target pass {total.tokens_per_target_pass:.2f}, rounds by tree nodes verified "
        f"{{{trees}}} (chains by drafts {{{chains}}}), drafter skipped in {total.skipped_drafter_rounds} steps"
    )
    print(
        f"(CPU threads: {torch.get_num_threads()}; target {dtype}, head {head_dtype}; greedy; {max_new_tokens} new tokens max)"
    )
    if dtype != "float32" and not all_equal:
        print(
            "note: in reduced precision a multi-token verify pass rounds differently from one-token steps, so"
        )
        print(
            "near-ties can flip and the text drifts from plain greedy; use float32 for bit-identical output."
        )
