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
            "eval.txt": "notes\n" + load_mtbench(limit=1)[0],
        },
    )
    assert read_documents(folder) == [("a/x.txt", "first"), ("b.md", "second"), ("c.py", "x = 1")]
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
        data_args=DataArguments(documents=folder, document_examples_per_length=2),
        head_args=HeadArguments(num_hidden_layers=1, draft_vocab_size=128),
        training_args=args,
    )
    assert summary["examples"] == 4 and summary["tokens"] == 2 * 32 + 2 * 64
