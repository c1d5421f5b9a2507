"""peagle.evaluation.long_context (behind benchmarks/bench_long_context.py) on a tiny random target and head
(behaviour only: nothing here is timed or compared by speed)."""

from __future__ import annotations

import json

import torch

from helpers import make_head, make_target
from peagle.evaluation import long_context
from peagle.evaluation.long_inputs import build_input
from peagle.evaluation.results import repeated_ngram_share, write_json_and_plot


def _examples(n: int = 10) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        size = 40 + 3 * i
        ids = torch.randint(5, 120, (size,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * 12 + [1] * (size - 12)})
    return out


def test_build_input_takes_whole_earlier_examples_then_the_prompt():
    examples = _examples()
    ids, info = build_input(examples, 3, 100, separator=[3])
    # examples 2 (46 + 1 tokens) and 1 (43 + 1) fit in 100 tokens, example 0 (40 + 1) would not
    assert info["context_examples"] == [1, 2] and info["context_tokens"] == 91 <= 100
    assert (
        ids == examples[1]["input_ids"] + [3] + examples[2]["input_ids"] + [3] + examples[3]["input_ids"][:12]
    )
    assert info["prompt_tokens"] == 12
    # going back wraps round to the end of the set, never reaching the prompt's own example
    _, info = build_input(examples, 0, 10_000)
    assert info["context_examples"] == list(range(1, 10))
    ids, info = build_input(examples, 5, 0)
    assert ids == examples[5]["input_ids"][:12] and info["context_tokens"] == 0


def test_long_inputs_put_documents_of_the_contexts_length_before_each_prompt(tmp_path):
    """`documents=FOLDER`: each prompt follows document text cut so context and prompt fit the context length, a
    different document first for each prompt; context 0 is the prompt alone; without documents, `build_input`'s."""
    from helpers import tiny_tokenizer
    from peagle.evaluation.long_inputs import long_inputs

    folder = tmp_path / "docs"
    folder.mkdir()
    for i, word in enumerate(["hello", "world", "code", "please"]):
        (folder / f"d{i}.txt").write_text(" ".join([word] * 60))
    examples, tok = _examples(), tiny_tokenizer()
    inputs = long_inputs(examples, [0, 50], [3, 4], [3], tok, str(folder))
    assert [ids for ids, _ in inputs[0]] == [examples[i]["input_ids"][:12] for i in (3, 4)]
    firsts = set()
    for (ids, info), index in zip(inputs[50], (3, 4)):
        assert (
            info["context_tokens"] == 50 - 12 and len(ids) == 50 and info["context_documents"] == str(folder)
        )
        assert ids[-12:] == examples[index]["input_ids"][:12]
        firsts.add(tuple(ids[:5]))
    assert len(firsts) == 2
    plain = long_inputs(examples, [100], [3], [3])
    assert plain[100] == [build_input(examples, 3, 100, [3])]


def test_extended_copy_computes_what_the_target_does():
    bench = long_context
    target = make_target()
    longer = bench.extended_copy(target, 2048)
    assert longer.config.max_position_embeddings == 2048 and target.config.max_position_embeddings == 512
    x = torch.randint(5, 120, (1, 40))
    with torch.no_grad():
        assert torch.equal(target(x).logits, longer(x).logits)
    assert longer.generation_config.eos_token_id == target.generation_config.eos_token_id


def test_run_long_context_rows_summary_and_files(tmp_path):
    bench = long_context
    target = make_target()  # max_position_embeddings 512: the 600-token context runs past it
    head = make_head(target)
    lines: list[str] = []
    settings = bench.LongContextSettings(max_new_tokens=12, separator=[3], repeats=1, extend_positions=2048)
    res = bench.run_long_context(
        target, head, _examples(16), [0, 100, 600], [6, 7], settings, log=lines.append
    )
    summary = res["summary"]
    assert [s["context"] for s in summary] == [0, 100, 600]
    assert [s["past_trained_range"] for s in summary] == [False, False, True]
    assert summary[2]["max_position_embeddings"] == 2048 and summary[2]["note"]
    assert all(s["identical"] and s["failed"] == 0 and s["timing_error"] is None for s in summary)
    assert all(
        s["tokens_per_target_pass"] >= 1.0 and s["plain_tokens_per_target_pass"] == 1.0 for s in summary
    )
    assert all(
        s["draft_round_ms"] > 0 and s["verify_ms"] > 0 and s["draft_verify_ratio"] > 0 for s in summary
    )
    assert all(r["context_tokens"] <= r["context"] for r in res["runs"]) and len(res["runs"]) == 6
    assert summary[2]["timing_cache_tokens"] > 512  # the timed cache is past the trained range too
    assert "PAST TRAINED 512" in lines[-1] and "PAST" not in lines[1]
    # every row says how much of its output repeats itself, and the table shows the mean
    assert all(0.0 <= r["repeated_ngrams"] <= 1.0 for r in res["runs"])
    assert summary[0]["repeated_ngrams_per_prompt"] == [r["repeated_ngrams"] for r in res["runs"][:2]]
    assert "repeat" in lines[0] and lines[1].split()[-3].endswith("%")
    js, png = write_json_and_plot(res, tmp_path, "long_context", bench.plot)
    assert json.loads(js.read_text())["summary"][2]["past_trained_range"] and png.stat().st_size > 1000


def test_a_context_past_the_extended_range_is_recorded_not_raised():
    bench = long_context
    target = make_target()
    head = make_head(target)
    settings = bench.LongContextSettings(max_new_tokens=4, repeats=1, extend_positions=520)
    res = bench.run_long_context(target, head, _examples(16), [600], [6], settings, log=lambda line: None)
    (s,) = res["summary"]
    assert s["failed"] == 1 and s["tokens_per_target_pass"] is None and s["identical"] is None
    assert "--extend-positions is 520" in res["runs"][0]["error"] and "520" in s["timing_error"]
    assert "1 failed" in bench.format_row(s)


def test_repeated_ngram_share_tells_a_loop_from_fresh_text():
    fresh = list(range(40))
    loop = [7, 8, 9, 10] * 10
    assert repeated_ngram_share(fresh) == 0.0
    # 33 windows of 8 tokens; all but the first 4 already occurred
    assert repeated_ngram_share(loop) == 29 / 33
    assert repeated_ngram_share(fresh[:20] + fresh[:20], n=8) == 13 / 33
    assert repeated_ngram_share([1, 2, 3], n=8) is None
