"""peagle.evaluation.long_output (behind benchmarks/bench_long_output.py): buckets of one long output's rounds."""

from __future__ import annotations

from helpers import make_head, make_target, prompt_ids
from peagle.evaluation.long_output import long_output_run, position_buckets


def test_position_buckets_count_each_round_where_it_starts():
    buckets = position_buckets([3, 0, 1, 3], bucket=4, total=10)
    assert [(b["start"], b["end"], b["tokens"], b["passes"]) for b in buckets] == [
        (0, 4, 5, 2),
        (4, 8, 3, 2),
        (8, 10, 2, 1),
    ]
    assert sum(b["tokens"] for b in buckets) == 10  # the last round is cut at the output's end


def test_long_output_run_observes_every_round_and_checks_the_output():
    target = make_target()
    head = make_head(target)
    settings = {"max_new_tokens": 40, "num_assistant_tokens": 3, "drafter_window": 0, "bucket": 16}
    run = long_output_run(target, head, prompt_ids(3, 6), settings)
    assert run["identical"]
    buckets = run["buckets"]
    assert [b["start"] for b in buckets] == [0, 16, 32] and sum(b["tokens"] for b in buckets) == 40
    passes = sum(b["passes"] for b in buckets)
    assert abs(40 / passes - run["tokens_per_target_pass"]) < 1e-9  # the observer saw every round
