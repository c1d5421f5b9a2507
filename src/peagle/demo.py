"""`peagle demo`: the embedded SmolLM2 target with and without the shipped P-EAGLE head."""

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
    head_dtype: str | None = "bfloat16",
) -> bool:
    """Generate for a few prompts with plain greedy decoding, with the head's default drafting rule (cost-aware
    unless a cut is given), and with K drafts every round; print equality, tokens/s and speedups side by side.

    `dtype` is the target's; `head_dtype` the drafter's (None: the target's).  Returns True when every
    speculative output equals the plain greedy output.
    """
    from .bench import chat_prompt_ids, timed_generate
    from .generation.stats import PEagleGenerationStats
    from .targets import load_default_drafter, load_default_target

    print("loading the embedded SmolLM2-135M-Instruct target and the default P-EAGLE head ...")
    target, tokenizer = load_default_target(dtype=getattr(torch, dtype))
    head = load_default_drafter(target, dtype=getattr(torch, head_dtype or dtype))
    k = num_speculative_tokens or head.config.num_speculative_tokens
    default_kw = {"assistant": head}
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
    rule = (
        f"confidence cut {confidence_threshold}"
        if confidence_threshold is not None
        else "cost-aware: each round verifies the drafts expected to pay on this machine"
    )
    print(
        f"head: {head.config.num_hidden_layers} layers, draft vocab {head.config.draft_vocab_size}, K={k}; {rule}"
    )
    ids0 = chat_prompt_ids(tokenizer, prompts[0])
    timed_generate(target, ids0, 8)  # warm-up (and, the first time, the cost model's short calibration)
    timed_generate(target, ids0, 8, **default_kw)
    all_equal = True
    totals = {"plain": [0, 0.0], "default": [0, 0.0], "fixed": [0, 0.0]}
    stats: list[PEagleGenerationStats] = []
    for text in prompts:
        ids = chat_prompt_ids(tokenizer, text)
        plain = timed_generate(target, ids, max_new_tokens)
        runs = {
            "default": timed_generate(target, ids, max_new_tokens, **default_kw),
            "fixed": timed_generate(target, ids, max_new_tokens, **fixed_kw),
        }
        stats.append(runs["default"].stats)
        equal = all(r.output == plain.output for r in runs.values())
        all_equal &= equal
        for name, r in (("plain", plain), *runs.items()):
            totals[name][0] += r.new_tokens
            totals[name][1] += r.seconds
        print("\n" + "=" * 78)
        print(f"user: {text}")
        print("-" * 78)
        print(tokenizer.decode(runs["default"].output, skip_special_tokens=True).strip())
        print("-" * 78)
        tps = {name: r.new_tokens / r.seconds for name, r in (("plain", plain), *runs.items())}
        print(
            f"identical to plain greedy: {equal} | plain {tps['plain']:.1f} tok/s | P-EAGLE default rule "
            f"{tps['default']:.1f} tok/s ({tps['default'] / tps['plain']:.2f}x) | K={k} every round "
            f"{tps['fixed']:.1f} tok/s ({tps['fixed'] / tps['plain']:.2f}x)"
        )
    total = PEagleGenerationStats.merge(stats)
    tps = {name: n / s for name, (n, s) in totals.items()}
    print("\n" + "=" * 78)
    print(
        f"TOTAL  outputs identical: {all_equal} | plain {tps['plain']:.1f} tok/s | P-EAGLE default rule "
        f"{tps['default']:.1f} tok/s, speedup {tps['default'] / tps['plain']:.2f}x | K={k} every round "
        f"{tps['fixed']:.1f} tok/s, speedup {tps['fixed'] / tps['plain']:.2f}x"
    )
    hist = ", ".join(f"{j}:{n}" for j, n in enumerate(total.chosen_k_histogram) if n)
    print(
        f"default rule: tokens per target pass {total.tokens_per_target_pass:.2f}, drafts verified per round "
        f"{{{hist}}}, drafter skipped in {total.skipped_drafter_rounds} steps"
    )
    print(
        f"(CPU threads: {torch.get_num_threads()}; target {dtype}, head {head.dtype}; greedy; {max_new_tokens} new tokens max)"
    )
    if dtype != "float32" and not all_equal:
        print(
            "note: in reduced precision a multi-token verify pass rounds differently from one-token steps, so"
        )
        print(
            "near-ties can flip and the text drifts from plain greedy; use float32 for bit-identical output."
        )
    return all_equal
