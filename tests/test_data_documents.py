"""Long teacher-forced examples from a folder of documents (issue #67): read, joined, cut, fully supervised."""

from __future__ import annotations

import pytest

from helpers import make_args, make_target, tiny_tokenizer
from peagle.data.documents import default_document_lengths, document_examples, read_documents

WORDS = ["hello", "you", "are", "a", "helpful", "bot"]


def write_folder(root, files: dict[str, str | bytes]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def test_read_documents_keeps_text_files_in_order_and_skips_the_rest(tmp_path):
    from peagle.data.evalsets import load_mtbench

    folder = write_folder(
        tmp_path,
        {
            "b.md": "second",
            "a/x.txt": "first",
            "c.py": "x = 1",
            "bad.txt": b"\xff\xfe\x00bad",
            "empty.txt": "  \n",
            "data.bin": "not read",
            "LICENSE": "licence",
            ".hidden": "not read",
            "eval.txt": "notes\n" + load_mtbench(limit=1)[0],
        },
    )
    assert read_documents(folder) == [
        ("LICENSE", "licence"),
        ("a/x.txt", "first"),
        ("b.md", "second"),
        ("c.py", "x = 1"),
    ]
    with pytest.raises(ValueError, match="not a folder"):
        read_documents(tmp_path / "missing")
    with pytest.raises(ValueError, match="no readable text files"):
        read_documents(write_folder(tmp_path / "none", {"x.bin": "1"}))
    stdlib = read_documents("stdlib")
    assert len(stdlib) > 100 and all(
        name.endswith(".py") and "test" not in name.split("/") for name, _ in stdlib
    )


def test_document_examples_join_and_cut_documents_and_supervise_every_token(tmp_path):
    tok = tiny_tokenizer()
    docs = [(f"d{i}", " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + 7 * i))) for i in range(6)]
    rows = document_examples(tok, docs, [40, 100], 3, seed=1, progress=False)
    assert [r["length"] for r in rows] == [40] * 3 + [100] * 3
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == r["length"]
        assert r["loss_mask"] == [0] + [1] * (r["length"] - 1) and r["source"] == "documents"
    assert rows == document_examples(tok, docs, [40, 100], 3, seed=1, progress=False)  # fixed by the seed
    assert rows != document_examples(tok, docs, [40, 100], 3, seed=2, progress=False)
    with pytest.raises(ValueError, match="needs more text"):
        document_examples(tok, docs[:1], [5000], 1, progress=False)


def test_default_lengths_follow_the_targets_range():
    assert default_document_lengths(8192, 8192) == [2048, 4096, 8192]
    assert default_document_lengths(8192, 4096) == [2048, 4096]
    assert default_document_lengths(131072) == [2048, 4096, 8192]
    assert default_document_lengths(2047) == []


def test_train_head_adds_document_examples(tmp_path, monkeypatch):
    """`documents=` alone is enough data: the long examples are made at the lengths max_length allows."""
    import peagle.data.documents as documents
    from peagle.training import DataArguments, HeadArguments
    from peagle.training.recipe import train_head

    monkeypatch.setattr(documents, "MIN_DOCUMENT_LENGTH", 32)  # tiny lengths for a tiny target
    folder = write_folder(tmp_path / "docs", {f"f{i}.txt": " ".join(WORDS * (5 + i)) for i in range(4)})
    target = make_target()
    args = make_args(tmp_path, max_length=64, per_device_train_batch_size=1)
    head, summary = train_head(
        target,
        tiny_tokenizer(),
        output_dir=tmp_path / "head",
        data_args=DataArguments(documents=folder, document_examples_per_length=2, document_questions=0),
        head_args=HeadArguments(num_hidden_layers=1, draft_vocab_size=128),
        training_args=args,
    )
    assert summary["examples"] == 4 and summary["tokens"] == 2 * 32 + 2 * 64


def test_document_questions_hold_the_documents_and_ask_one_question():
    """Each prompt is documents cut to leave room for an answer at its length, then one of the questions."""
    from peagle.data.documents import DOCUMENT_QUESTIONS, document_questions

    tok = tiny_tokenizer()
    docs = [(f"f{i}.txt", " ".join(WORDS * 20)) for i in range(3)]
    prompts = document_questions(tok, docs, [200, 400], 4, answer_tokens=40, seed=1)
    assert len(prompts) == 4
    for i, prompt in enumerate(prompts):
        body, question = prompt.rsplit("\n\n", 1)
        assert question in DOCUMENT_QUESTIONS and "hello" in body
        assert len(tok(body, add_special_tokens=False).input_ids) <= [200, 400][i % 2] - 40 - 64
    assert len(tok(prompts[1], add_special_tokens=False).input_ids) > 200  # the lengths take turns


def test_train_head_answers_questions_about_the_documents(tmp_path, monkeypatch):
    """`document_questions=N`: the target's own answers to N questions about the documents join the long examples;
    their loss covers the answer only, after the whole document in the prompt."""
    import peagle.data.documents as documents
    from peagle.training import DataArguments
    from peagle.training.recipe import gather_examples

    monkeypatch.setattr(documents, "MIN_DOCUMENT_LENGTH", 128)
    folder = write_folder(tmp_path / "docs", {f"f{i}.txt": " ".join(WORDS * (20 + i)) for i in range(4)})
    args = make_args(tmp_path, max_length=256)
    data = DataArguments(
        documents=str(folder), document_examples_per_length=1, document_questions=3, max_new_tokens=8
    )
    rows = gather_examples(make_target(), tiny_tokenizer(), str(tmp_path), args, data, [], [])
    asked = [r for r in rows if r.get("source") == "document questions"]
    assert len(rows) == 2 + 3 and len(asked) == 3
    for row in asked:
        first = row["loss_mask"].index(1)
        assert first > 40 and sum(row["loss_mask"]) <= 8  # a long prompt of documents, a short answer


def test_auto_documents_make_long_examples_where_the_targets_range_allows(tmp_path, monkeypatch):
    """The default (`documents="auto"`, `max_length` 8,192) adds long examples from Python's own sources when the
    target's range reaches the shortest length, and nothing (silently) when it does not, or for `"none"`."""
    import peagle.data.documents as documents
    from peagle.training import DataArguments, PEagleTrainingArguments
    from peagle.training.recipe import gather_examples, resolved_documents

    assert (
        DataArguments().documents == "auto"
        and PEagleTrainingArguments(output_dir=str(tmp_path)).max_length == 8192
    )
    target, tok = make_target(), tiny_tokenizer()  # 512 positions
    assert resolved_documents("auto", target, tok, 8192) is None
    assert resolved_documents("none", target, tok, 8192) is None
    assert resolved_documents(str(tmp_path), target, tok, 8192) == str(tmp_path)
    monkeypatch.setattr(documents, "MIN_DOCUMENT_LENGTH", 128)
    assert resolved_documents("auto", target, tok, 8192) == "stdlib"
    assert (
        resolved_documents("auto", target, None, 8192) is None
    )  # token ids only: nothing to encode text with
    read = []
    real_read = documents.read_documents
    monkeypatch.setattr(
        documents, "read_documents", lambda source: read.append(source) or real_read(source)[:40]
    )
    data = DataArguments(document_examples_per_length=1, document_questions=0)
    rows = gather_examples(target, tok, str(tmp_path), make_args(tmp_path), data, [], [])
    assert read == ["stdlib"] and [r["length"] for r in rows] == [128, 256, 512]
    none = DataArguments(documents="none")
    assert gather_examples(target, tok, str(tmp_path), make_args(tmp_path), none, [], []) == []


def test_documents_without_room_for_long_examples_say_why(tmp_path, caplog):
    """Named documents on a target whose range is under 2K tokens: no long examples, and a warning that names
    max_length and the target's positions."""
    from peagle.training import DataArguments
    from peagle.training.recipe import gather_examples

    folder = write_folder(tmp_path / "docs", {"a.txt": " ".join(WORDS * 50)})
    data = DataArguments(documents=str(folder), document_questions=0)
    with caplog.at_level("WARNING", logger="peagle.training.recipe"):
        rows = gather_examples(
            make_target(), tiny_tokenizer(), str(tmp_path), make_args(tmp_path), data, [], []
        )
    assert rows == []
    assert "max_length 8192 and the target's 512 positions leave no room" in caplog.text


def test_a_documents_folder_that_is_not_there_is_refused_when_parsed(tmp_path):
    """A documents setting is checked where it enters, before any target loads or answers are generated: a
    folder, 'stdlib', 'auto' or 'none'."""
    from peagle.training import DataArguments

    for value in ("auto", "none", "stdlib", str(tmp_path)):
        DataArguments(documents=value)
    for value in (str(tmp_path / "missing"), str(write_folder(tmp_path, {"f.txt": "x"}) / "f.txt")):
        with pytest.raises(
            ValueError, match=r"documents is '.*', not a folder; expected a folder of text files"
        ):
            DataArguments(documents=value)
