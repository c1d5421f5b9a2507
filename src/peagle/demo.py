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
    """Generate for a few prompts with and without the head; print equality, tokens/s, speedup, tau.

    `dtype` is the target's; `head_dtype` the drafter's (None: the target's).
    Returns True when every speculative output equals the plain greedy output.
    """
    from .bench import chat_prompt_ids, method_kwargs, timed_generate
    from .generation.stats import PEagleGenerationStats
    from .targets import load_default_drafter, load_default_target

    print("loading the embedded SmolLM2-135M-Instruct target and the default P-EAGLE head ...")
    target, tokenizer = load_default_target(dtype=getattr(torch, dtype))
    head = load_default_drafter(target, dtype=getattr(torch, head_dtype or dtype))
    k = num_speculative_tokens or head.config.num_speculative_tokens
    if confidence_threshold is None:
        confidence_threshold = head.config.confidence_threshold
    cut = f", confidence threshold {confidence_threshold}" if confidence_threshold else ", no confidence cut"
    print(
        f"head: {head.config.num_hidden_layers} layers, draft vocab {head.config.draft_vocab_size}, K={k}{cut}"
    )
    all_equal, plain_s, spec_s, plain_n, spec_n, stats = True, 0.0, 0.0, 0, 0, []
    for text in prompts:
        ids = chat_prompt_ids(tokenizer, text)
        timed_generate(target, ids, 8)  # warm-up
        plain = timed_generate(target, ids, max_new_tokens)
        spec = timed_generate(
            target,
            ids,
            max_new_tokens,
            **method_kwargs("peagle", k, {"peagle": head}, confidence_threshold),
        )
        equal = plain.output == spec.output
        all_equal &= equal
        plain_s, spec_s = plain_s + plain.seconds, spec_s + spec.seconds
        plain_n, spec_n = plain_n + plain.new_tokens, spec_n + spec.new_tokens
        stats.append(spec.stats)
        print("\n" + "=" * 78)
        print(f"user: {text}")
        print("-" * 78)
        print(tokenizer.decode(spec.output, skip_special_tokens=True).strip())
        print("-" * 78)
        print(
            f"identical to plain greedy: {equal} | plain {plain.new_tokens / plain.seconds:.1f} tok/s | "
            f"P-EAGLE {spec.new_tokens / spec.seconds:.1f} tok/s | speedup {plain.seconds / spec.seconds * spec.new_tokens / max(plain.new_tokens, 1):.2f}x | "
            f"tokens per target pass {spec.stats.tokens_per_target_pass:.2f}"
        )
    total = PEagleGenerationStats.merge(stats)
    print("\n" + "=" * 78)
    print(
        f"TOTAL  outputs identical: {all_equal} | plain {plain_n / plain_s:.1f} tok/s | P-EAGLE {spec_n / spec_s:.1f} tok/s"
        f" | speedup {(spec_n / spec_s) / (plain_n / plain_s):.2f}x | tokens per target pass {total.tokens_per_target_pass:.2f}"
        f" | acceptance length {total.acceptance_length:.2f}"
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
