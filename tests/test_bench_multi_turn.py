"""peagle.evaluation.multi_turn (behind benchmarks/bench_multi_turn.py) on a tiny target, head and tokenizer:
behaviour only (nothing here is timed or compared by speed)."""

from __future__ import annotations

import torch

from helpers import LAYERS, make_head, make_target, tiny_tokenizer
from peagle.evaluation import multi_turn


def test_turn_input_extends_the_previous_output():
    tok = tiny_tokenizer()
    first = multi_turn.turn_input(tok, None, multi_turn.Turn("hello world"), system="you are a bot")
    assert first[0, 0] == tok.convert_tokens_to_ids("<|im_start|>")
    answer = torch.cat([first, torch.tensor([[20, 21]])], dim=1)  # cut at the length limit: no <|im_end|>
    nxt = multi_turn.turn_input(tok, answer, multi_turn.Turn("write code", document="the of and"))
    assert torch.equal(nxt[:, : answer.shape[1]], answer)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert int(nxt[0, answer.shape[1]]) == end  # the answer is closed before the next user turn
    closed = torch.cat([answer, torch.tensor([[end]])], dim=1)
    after = multi_turn.turn_input(tok, closed, multi_turn.Turn("please"))
    assert int(after[0, closed.shape[1]]) != end  # closed already: not twice


def test_conversation_runs_both_sides_with_their_caches(tmp_path):
    target = make_target(num_hidden_layers=LAYERS, eos_token_id=None)
    head = make_head(target)
    tok = tiny_tokenizer()
    turns = multi_turn.conversation_turns(
        ["hello world", "write code", "please the"], ["the of and to"] * 2, 3
    )
    assert [bool(t.document) for t in turns] == [True, False, True]
    records = multi_turn.run_conversation(target, tok, head, turns, max_new_tokens=6, system="you are a bot")
    assert len(records) == 3 and all(r["identical"] for r in records)
    assert records[0]["cached_tokens"] == 0
    for before, after in zip(
        records, records[1:]
    ):  # each turn starts from all but the last token of the one before
        assert after["cached_tokens"] == before["input_tokens"] + before["new_tokens"] - 1
        assert after["catch_up_tokens"] == 0  # the head's state came with the cache
    summary = multi_turn.summarize([records])
    assert summary["turns"] == 3 and summary["all_identical"]
    assert summary["final_context_tokens"] == [records[-1]["input_tokens"] + records[-1]["new_tokens"]]
    assert "overall" in multi_turn.format_table([records], summary)
    png = multi_turn.plot([records], tmp_path / "multi_turn.png")
    assert png.stat().st_size > 0
