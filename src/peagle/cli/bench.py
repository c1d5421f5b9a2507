"""`peagle bench`: greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ._common import DTYPES, dataclass_parent, head_dtype_field, target_field


@dataclass
class BenchArguments:
    """The settings of `peagle bench` (each field is a flag of the same name)."""

    limit: int | None = field(default=None, metadata={"help": "prompts per set (default: all; 80 and 164)"})
    ks: str = field(
        default="1,2,3,4,5,6,7,8,9,10", metadata={"help": "comma-separated K values (fixed K rows)"}
    )
    max_new_tokens: int = 128
    repeats: int = field(default=3, metadata={"help": "timed repeats per run; the median is kept"})
    datasets: str = "mtbench,humaneval"
    methods: str = field(
        default="greedy,peagle,eagle3,pld",
        metadata={
            "help": "comma-separated: greedy, peagle, eagle3, pld; with a vLLM environment also vllm, vllm-peagle, "
            "vllm-eagle3 (vLLM plain / with the head's vLLM export, same prompts and lengths)"
        },
    )
    vllm_python: str | None = field(
        default=None,
        metadata={
            "help": "Python interpreter of a vLLM environment, for the vllm* methods (default: $PEAGLE_VLLM_PYTHON)"
        },
    )
    target: str | None = target_field()
    head: str | None = field(
        default=None,
        metadata={"help": "P-EAGLE head folder (default: the shipped head; needed with --target)"},
    )
    ar_head: str | None = field(
        default=None,
        metadata={
            "help": "autoregressive head folder (default: the shipped EAGLE-3 head; with --target: none, rows "
            "skipped)"
        },
    )
    dtype: str = field(default="float32", metadata={"choices": DTYPES, "help": "target dtype"})
    head_dtype: str = head_dtype_field()
    out: str = field(default="bench_results", metadata={"help": "folder for bench.json and bench.png"})
    confidence_threshold: float = field(
        default=0.0,
        metadata={
            "help": "assistant_confidence_threshold of the fixed-K rows (default 0: K drafts every round)"
        },
    )
    batch_sizes: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated batch sizes, e.g. 1,2,4,8: run the batched benchmark instead (plain batched "
            "greedy against the heads at each B on the same left-padded prompts; writes bench_batch.json/.png)"
        },
    )
    tree_sizes: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated draft-tree node budgets, e.g. 0,8,16,32,64 (0: the chain): run the tree "
            "benchmark instead (tokens per target pass against the budget for each head, with and without "
            "prompt-lookup branches, K = the first of --ks; writes bench_tree.json/.png)"
        },
    )
    contexts: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated context lengths in tokens, e.g. 0,2048,4096,8192: run the long-context "
            "benchmark instead (--limit held-out prompts of --examples, default 3, each after that many tokens of "
            "earlier examples or --context_source documents; the P-EAGLE head's default rule against plain "
            "greedy: tokens per target pass and speed; writes long_context.json/.png)"
        },
    )
    context_source: str = field(
        default="conversations",
        metadata={
            "help": "long-context benchmark: 'conversations' (earlier --examples) or a folder of documents put "
            "before each prompt"
        },
    )
    lookups: str = field(
        default="0,10",
        metadata={
            "help": "tree benchmark: prompt-lookup branch lengths to try (0: none); also rows of prompt lookup alone"
        },
    )
    examples: str | None = field(
        default=None,
        metadata={
            "help": "tree and batch benchmarks: held-out examples (shards or JSONL) whose prompts form a set of "
            "their own ('heldout'); with --skip and --limit"
        },
    )
    skip: int = field(default=0, metadata={"help": "examples to skip in --examples"})
    speed: bool = field(
        default=True,
        metadata={"help": "tree benchmark: time the default-rule rows (--no_speed: acceptance only)"},
    )
    default_rule: bool = field(
        default=True,
        metadata={
            "help": "run each head with its default rule (cost-aware drafting) too (--no_default_rule: skip those "
            "rows)"
        },
    )


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "bench",
        help="greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval",
        parents=[dataclass_parent(BenchArguments)],
    )


def _ints(text: str, name: str, low: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise SystemExit(f"peagle bench: --{name} must be comma-separated integers, got {text!r}") from err
    if not values or min(values) < low:
        raise SystemExit(f"peagle bench: --{name} needs integers >= {low}, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    # validate everything before anything heavy loads
    ks = _ints(args.ks, "ks")
    if args.batch_sizes is not None:
        _ints(args.batch_sizes, "batch_sizes")
    if args.tree_sizes is not None:
        _ints(args.tree_sizes, "tree_sizes", low=0)
        _ints(args.lookups, "lookups", low=0)
        if args.examples is None and not args.datasets.strip():
            raise SystemExit("peagle bench: --tree_sizes needs prompts: --datasets and/or --examples")
    if args.contexts is not None:
        _ints(args.contexts, "contexts", low=0)
        if args.examples is None:
            raise SystemExit("peagle bench: --contexts needs held-out prompts: --examples (shards or JSONL)")
    if args.skip < 0:
        raise SystemExit(f"peagle bench: --skip must be >= 0, got {args.skip}")
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"peagle bench: --limit must be >= 1, got {args.limit}")
    if args.repeats < 1 or args.max_new_tokens < 1:
        raise SystemExit("peagle bench: --repeats and --max_new_tokens must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    import os

    import torch

    from ..data.evalsets import EVAL_SETS, load_eval_prompts
    from ..evaluation.bench import check_methods, format_table, run_benchmark, write_results
    from ..evaluation.timing import timed_generate
    from ..integrations.vllm.process import VLLM_PYTHON_ENV
    from ..modeling_peagle import PEagleDrafter
    from ..runtime import resolve_dtype
    from ..targets import default_drafter_path, load_target

    vllm_python = args.vllm_python or os.environ.get(VLLM_PYTHON_ENV)
    try:
        check_methods(methods, vllm_python)
    except ValueError as err:
        raise SystemExit(f"peagle bench: {err}") from err
    unknown = [d for d in datasets if d not in EVAL_SETS]
    if unknown:
        raise SystemExit(f"peagle bench: unknown datasets {unknown}; expected some of {sorted(EVAL_SETS)}")
    target, tokenizer = load_target(args.target or "default", dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise SystemExit(
            f"peagle bench: the target {args.target} has no tokenizer (needed for the chat prompts)"
        )
    heads = {}
    head_dtype = resolve_dtype(args.head_dtype)
    default_target = args.target in (None, "default")
    for method, path in (("peagle", args.head), ("eagle3", args.ar_head)):
        if method not in methods:
            continue
        if path is None and not default_target:  # the shipped heads fit only the embedded target
            if method == "peagle":
                raise SystemExit(f"peagle bench: --target {args.target} needs --head (a head trained for it)")
            print(f"peagle bench: no --ar_head for --target {args.target}: skipping the eagle3 rows")
            methods.remove(method)
            continue
        folder = path or default_drafter_path(method)
        head = PEagleDrafter.from_pretrained(folder, dtype=head_dtype)
        try:
            heads[method] = head.attach_target(target).eval()
        except ValueError as err:
            raise SystemExit(f"peagle bench: {folder} does not fit the target: {err}") from err
    if args.contexts is not None:
        return _run_contexts(args, target, tokenizer, heads, head_dtype)
    prompts = load_eval_prompts(tokenizer, datasets, args.limit)
    if args.tree_sizes is not None:
        return _run_trees(args, target, prompts, heads, ks[0], head_dtype)
    if args.batch_sizes is not None:
        return _run_batches(args, target, tokenizer, prompts, heads, head_dtype)
    timed_generate(target, prompts[datasets[0]][0], 4)  # warm-up
    for head in heads.values():  # and the heads' cost models (measured once per machine, then cached)
        timed_generate(target, prompts[datasets[0]][0], 4, assistant=head)
    warmup_timing = _prepare_costs(target, heads, [1], prompts, args.max_new_tokens)
    results = run_benchmark(
        target,
        prompts,
        heads,
        ks=ks,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        methods=methods,
        confidence_threshold=args.confidence_threshold,
        default_rule=args.default_rule,
    )
    if any(m.startswith("vllm") for m in methods):
        results = _add_vllm_rows(results, args, methods, vllm_python, target, prompts, ks)
    results["warmup_cost_timing_seconds"] = warmup_timing
    return _finish(results, args, head_dtype, write_results, format_table, "plain greedy (see 'lossless')")


def _run_batches(args, target, tokenizer, prompts, heads, head_dtype) -> int:
    """`--batch_sizes`: the batched benchmark on the prompts of every set, interleaved (mixed lengths)."""
    import itertools

    import torch

    from ..evaluation.bench_batch import (
        format_batch_table,
        left_pad,
        run_batch_benchmark,
        write_batch_results,
    )

    sizes = _ints(args.batch_sizes, "batch_sizes")
    prompts = _with_heldout(args, prompts)
    mixed = [p for group in itertools.zip_longest(*prompts.values()) for p in group if p is not None]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    # warm-up, and each head's cost model at every batch size (measured once per machine, then cached)
    for batch in sizes:
        ids, mask = left_pad(mixed[:batch], pad)
        for head in [None, *heads.values()]:
            extra = {"assistant_model": head} if head is not None else {}
            with torch.inference_mode():
                target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, **extra)
    warmup_timing = _prepare_costs(target, heads, sizes, {"all": mixed}, args.max_new_tokens)
    results = run_batch_benchmark(
        target, mixed, heads, sizes, args.max_new_tokens, pad_token_id=pad, eos_token_ids=eos
    )
    results["warmup_cost_timing_seconds"] = warmup_timing
    return _finish(
        results,
        args,
        head_dtype,
        write_batch_results,
        format_batch_table,
        "plain batched greedy (see '= plain batched')",
    )


def _record_run(results: dict, args: argparse.Namespace, head_dtype) -> None:
    """What every benchmark result records of its run: the machine, the head dtype and the command."""
    from ..evaluation.timing import machine_description

    results["machine"] = machine_description()
    results["head_dtype"] = str(head_dtype).removeprefix("torch.")
    results["command"] = "peagle bench " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k not in ("func", "command") and v is not None
    )


def _finish(results: dict, args: argparse.Namespace, head_dtype, write, table, reference: str) -> int:
    """Record the run, write the JSON and the plot, print the table; exit status 1 unless every output equals
    `reference`."""
    _record_run(results, args, head_dtype)
    js, png = write(results, args.out)
    print(table(results["summary"]))
    print(f"\nwrote {js} and {png}")
    lossless = all(s["lossless"] for s in results["summary"])
    if not lossless:
        print(f"WARNING: some speculative outputs differ from {reference}")
    return 0 if lossless else 1


def _prepare_costs(target, heads: dict, batch_sizes, prompts: dict, max_new_tokens: int) -> float:
    """Time, before any measured run, what the heads' cost rule would otherwise time once per machine inside
    one: each curve at every batch size, the context point the longest prompt plus `max_new_tokens` reaches,
    and the plain steps per row count.  Returns the seconds spent (recorded with the results)."""
    from ..generation.cost import extend_to_context, prepare_cost_model
    from ..generation.settings import AUTO_TREE_NODES

    longest = max((p.shape[-1] for group in prompts.values() for p in group), default=0) + max_new_tokens
    spent = 0.0
    for head in heads.values():
        if head.config.confidence_threshold is not None:  # a fixed cut: no cost rule, nothing to time
            continue
        tokens = max(head.config.num_speculative_tokens, AUTO_TREE_NODES) + 1
        for batch in batch_sizes:
            model, seconds = prepare_cost_model(target, head, tokens, batch)
            spent += seconds + extend_to_context(
                model, target, head, longest, len(model.verify_seconds), batch
            )
    return spent


def _with_heldout(args, prompts: dict) -> dict:
    """The evaluation prompts with the held-out examples' prompts (`--examples`, `--skip`, `--limit`) first."""
    if args.examples is None:
        return prompts
    from ..data.shards import load_examples
    from ..generation.calibration import prompts_of_examples

    held = prompts_of_examples(load_examples(args.examples))[args.skip :]
    return {"heldout": held[: args.limit] if args.limit else held, **prompts}


def _run_trees(args, target, prompts, heads, k, head_dtype) -> int:
    """`--tree_sizes`: tokens per target pass against the node budget (both heads, with and without lookup)."""
    import torch

    from ..evaluation.bench_tree import format_tree_table, run_tree_benchmark, write_tree_results

    prompts = _with_heldout(args, prompts)
    warmup_timing = _prepare_costs(target, heads, [1], prompts, args.max_new_tokens)
    for (
        head
    ) in heads.values():  # warm-up, and each head's cost model (measured once per machine, then cached)
        first = next(iter(prompts.values()))[0]
        with torch.inference_mode():
            target.generate(first, max_new_tokens=4, do_sample=False, assistant_model=head)
    results = run_tree_benchmark(
        target,
        prompts,
        heads,
        tree_sizes=_ints(args.tree_sizes, "tree_sizes", low=0),
        num_speculative_tokens=k,
        lookups=_ints(args.lookups, "lookups", low=0),
        max_new_tokens=args.max_new_tokens,
        speed=args.speed,
    )
    results["warmup_cost_timing_seconds"] = warmup_timing
    return _finish(
        results, args, head_dtype, write_tree_results, format_tree_table, "plain greedy (see '= greedy')"
    )


def _run_contexts(args, target, tokenizer, heads, head_dtype) -> int:
    """`--contexts`: the P-EAGLE head's default rule against plain greedy after long contexts."""
    from ..data.shards import load_examples
    from ..evaluation.long_context import LongContextSettings, plot, run_long_context
    from ..evaluation.long_inputs import checked_long_inputs
    from ..evaluation.results import write_json_and_plot

    if "peagle" not in heads:
        raise SystemExit("peagle bench: --contexts measures the P-EAGLE head: keep peagle in --methods")
    contexts = _ints(args.contexts, "contexts", low=0)
    examples = load_examples(args.examples)
    indices = list(range(args.skip, min(args.skip + (args.limit or 3), len(examples))))
    if not indices:
        raise SystemExit(f"peagle bench: {args.examples} holds {len(examples)} examples; --skip {args.skip}")
    try:
        separator, inputs = checked_long_inputs(examples, tokenizer, contexts, indices, args.context_source)
    except ValueError as err:
        raise SystemExit(f"peagle bench: {err}") from err
    settings = LongContextSettings(
        max_new_tokens=args.max_new_tokens, separator=separator, repeats=args.repeats, timing=False
    )
    results = run_long_context(target, heads["peagle"], examples, contexts, indices, settings, inputs=inputs)
    results["config"].update(examples=args.examples, context_source=args.context_source)
    _record_run(results, args, head_dtype)
    js, png = write_json_and_plot(results, args.out, "long_context", plot)
    print(f"\nwrote {js} and {png}")
    lossless = all(s["identical"] is not False and not s["failed"] for s in results["summary"])
    if not lossless:
        print("WARNING: some speculative outputs differ from plain greedy (or failed)")
    return 0 if lossless else 1


def _add_vllm_rows(results, args, methods, vllm_python, target, prompts, ks):
    """The vllm* methods: export the heads to vLLM's layout, run vLLM on the same prompts, re-summarize."""
    import tempfile

    import torch

    from ..evaluation.bench import run_vllm_rows, summarize
    from ..formats import export
    from ..modeling_peagle import PEagleDrafter
    from ..targets import default_drafter_path, default_target_path

    target_spec = args.target or "default"
    target_for_vllm = default_target_path() if target_spec == "default" else target_spec
    references = {(r["dataset"], r["prompt"]): r["output"] for r in results["runs"] if r.get("output")}
    with tempfile.TemporaryDirectory(prefix="peagle-bench-vllm-") as tmp:
        head_dirs = {}
        for method, path in (("peagle", args.head), ("eagle3", args.ar_head)):
            if f"vllm-{method}" not in methods:
                continue
            if path is None and target_spec != "default":
                raise SystemExit(
                    f"peagle bench: vllm-{method} with --target {target_spec} needs --head / --ar_head"
                )
            head = PEagleDrafter.from_pretrained(path or default_drafter_path(method), dtype=torch.float32)
            head_dirs[method] = export(head, f"{tmp}/{method}", layout="vllm", target_model=target)
        rows = run_vllm_rows(
            vllm_python,
            target_for_vllm,
            prompts,
            head_dirs,
            ks=ks,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            methods=[m for m in methods if m.startswith("vllm")],
            dtype=args.dtype,
            references=references or None,
        )
    results["runs"].extend(rows)
    results["summary"] = summarize(results["runs"])
    return results
