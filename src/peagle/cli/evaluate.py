"""`peagle evaluate`: held-out acceptance of heads, K drafts every round (decoded, or teacher-forced)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import dataclass_from_args, dataclass_parent


def add_parser(sub) -> argparse.ArgumentParser:
    from ..evaluation.acceptance import EvaluateArguments

    return sub.add_parser(
        "evaluate",
        help="held-out new tokens per target pass of heads drafting K every round, checked against plain greedy",
        parents=[dataclass_parent(EvaluateArguments)],
    )


def run(args: argparse.Namespace) -> int:
    from ..evaluation.acceptance import EvaluateArguments

    settings = dataclass_from_args(EvaluateArguments, args)
    if settings.pool:
        return pool(settings)
    if settings.write_greedy:
        return write_greedy(settings)
    return evaluate(settings)


def pool(settings) -> int:
    from ..evaluation.acceptance import pool_results, report

    if settings.heads or settings.examples:
        raise ValueError("--pool reads earlier results: give no --heads and no --examples")
    pooled = pool_results([json.loads(Path(f).read_text()) for f in settings.pool])
    pooled["settings"]["pooled_from"] = settings.pool
    report(pooled["results"], pooled["settings"]["num_speculative_tokens"])
    if settings.out:
        Path(settings.out).write_text(json.dumps(pooled, indent=2))
    return 0


def write_greedy(settings) -> int:
    from ..evaluation.acceptance import write_greedy
    from ..targets import load_default_target

    if settings.heads or settings.teacher_forced or not settings.examples:
        raise ValueError("--write_greedy decodes plain greedy only: give --examples and no --heads")
    write_greedy(load_default_target()[0], settings)
    return 0


def evaluate(settings) -> int:
    import dataclasses

    from ..evaluation.acceptance import decode, heldout_spec, report, teacher_forced
    from ..runtime import resolve_dtype_name
    from ..targets import load_default_target

    if not settings.heads or not settings.examples:
        raise ValueError("give --heads and --examples (or --pool)")
    if settings.teacher_forced and len(settings.examples) > 1:
        raise ValueError("--teacher_forced takes one --examples set")
    settings.head_dtype = resolve_dtype_name(settings.head_dtype)  # recorded resolved
    target, _ = load_default_target()
    if settings.teacher_forced:
        settings.examples, settings.skip, settings.limit = heldout_spec(
            settings.examples[0], settings.skip, settings.limit
        )
        results = teacher_forced(target, settings)
    else:
        results = decode(target, settings)
        report(results, settings.num_speculative_tokens)
    if settings.out:
        record = {"settings": dataclasses.asdict(settings), "results": results}
        Path(settings.out).write_text(json.dumps(record, indent=2))
    return 0
