"""Token-id shards: round trip, dtypes, the manifest, append-only growth, corruption errors, the packing script."""

from __future__ import annotations

import doctest
import json
import os
import re

import pytest
import torch

from helpers import make_target
from peagle.data import load_examples, read_shards, save_examples, shards, write_shard
from peagle.data.shards import parse_cycle_ranges, read_manifest


def test_docstring_examples():
    result = doctest.testmod(shards, verbose=False)
    assert result.failed == 0 and result.attempted > 0


def examples(n: int, seed: int = 0, vocab: int = 49152) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        prompt = int(torch.randint(0, length, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def test_round_trip_and_manifest_counts(tmp_path):
    data = examples(7)
    entry = write_shard(data, tmp_path / "s", source="magpie", target_name="tiny", dtype=torch.bfloat16)
    assert read_shards(tmp_path / "s") == data
    assert load_examples(tmp_path / "s") == data
    manifest = read_manifest(tmp_path / "s")
    assert manifest["shards"] == [entry]
    assert entry["file"] == "shard-00000.safetensors" and entry["source"] == "magpie"
    assert entry["examples"] == 7
    assert entry["tokens"] == sum(len(e["input_ids"]) for e in data)
    assert entry["response_tokens"] == sum(sum(e["loss_mask"]) for e in data)
    assert entry["target"] == "tiny" and entry["dtype"] == "bfloat16" and entry["input_ids_dtype"] == "uint16"
    assert entry["created"] and entry["peagle_version"] and len(entry["sha256"]) == 64
    # about two bytes per token
    size = os.path.getsize(tmp_path / "s" / entry["file"])
    assert size < 2 * entry["tokens"] + 8 * 8 + 4 * 7 + 1024


def test_large_ids_and_free_form_loss_masks(tmp_path):
    big = examples(3, seed=1, vocab=200_000)
    multi_turn = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 0, 1, 1]},
        {"input_ids": [1], "loss_mask": [0]},
    ]
    e1 = write_shard(big, tmp_path, source="a", target_name="t")
    e2 = write_shard(multi_turn, tmp_path, source="b", target_name="t")
    assert e1["input_ids_dtype"] == "int32" and e2["input_ids_dtype"] == "uint16"
    assert read_shards(tmp_path) == big + multi_turn
    assert read_shards(tmp_path, sources=["b"]) == multi_turn
    assert e2["response_tokens"] == 3
    with pytest.raises(ValueError, match="only 0 and 1"):
        write_shard([{"input_ids": [1, 2], "loss_mask": [0, 2]}], tmp_path, source="c", target_name="t")
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        write_shard([{"input_ids": [1, 2], "loss_mask": [0]}], tmp_path, source="c", target_name="t")
    assert len(read_manifest(tmp_path)["shards"]) == 2


def test_appending_never_rewrites_old_shards(tmp_path):
    write_shard(examples(4), tmp_path, source="a", target_name="t")
    first = tmp_path / "shard-00000.safetensors"
    before = (first.read_bytes(), os.stat(first).st_mtime_ns)
    write_shard(examples(5, seed=2), tmp_path, source="b", target_name="t", extra={"rows": [0, 9]})
    assert (first.read_bytes(), os.stat(first).st_mtime_ns) == before
    manifest = read_manifest(tmp_path)
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert manifest["shards"][1]["rows"] == [0, 9]
    assert len(read_shards(tmp_path)) == 9


def test_corrupted_or_mismatched_shards_name_the_file(tmp_path):
    write_shard(examples(4), tmp_path, source="a", target_name="t")
    path = tmp_path / "shard-00000.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-6] + bytes(6))
    with pytest.raises(ValueError, match="shard-00000.safetensors is corrupted"):
        read_shards(tmp_path)
    path.write_bytes(good[:40])
    manifest = read_manifest(tmp_path)
    del manifest["shards"][0]["sha256"]  # without the checksum the reader still fails, naming the file
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shard-00000.safetensors cannot be read"):
        read_shards(tmp_path)
    path.write_bytes(good)
    manifest["shards"][0]["examples"] = 5
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"shard-00000.safetensors does not match manifest.json \(examples"):
        read_shards(tmp_path)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="shard-00000.safetensors"):
        read_shards(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a shard folder"):
        read_shards(tmp_path / "nowhere")


def test_jsonl_examples_still_load(tmp_path):
    data = examples(3)
    save_examples(data, tmp_path / "ex.jsonl")
    assert load_examples(tmp_path / "ex.jsonl") == data
    with pytest.raises(FileNotFoundError):
        load_examples(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"input_ids": [1, 2, 3]}', r"line 2: no 'loss_mask' field \(found \['input_ids'\]\)"),
        ('{"loss_mask": [0, 1]}', r"line 2: no 'input_ids' field"),
        ('{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}', r"line 2: loss_mask has 2 entries, input_ids 3"),
        (
            '{"input_ids": ["1", "2"], "loss_mask": [0, 1]}',
            r"line 2: input_ids holds '1' \(str\); expected integers",
        ),
        (
            '{"input_ids": "1 2", "loss_mask": [0, 1]}',
            r"line 2: input_ids is '1 2'; expected a non-empty list",
        ),
        (
            '{"input_ids": [1, 2], "loss_mask": [0, 2]}',
            r"line 2: loss_mask holds 2; expected only 0 .* and 1",
        ),
        ('{"input_ids": [1, -2], "loss_mask": [0, 1]}', r"line 2: input_ids holds -2"),
        ("[1, 2]", r"line 2: expected a JSON object with input_ids and loss_mask, got a list"),
        ('{"input_ids": [1, 2], "loss_mask": [0,', r"line 2: not valid JSON \(the file looks truncated\)"),
    ],
)
def test_bad_jsonl_examples_name_the_file_and_the_line(tmp_path, line, message):
    path = tmp_path / "ex.jsonl"
    path.write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"examples file '.*ex\.jsonl', " + message):
        load_examples(path)


def test_non_utf8_or_empty_examples_files_are_named(tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2], "loss_mask": [0, 1]}\n{"input_ids": [1], "note": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"ex\.jsonl', line 2: not UTF-8 text"):
        load_examples(path)
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"examples file '.*ex\.jsonl' holds no examples \(it is empty\)"):
        load_examples(path)
    # a truncated middle line is not called truncated
    path.write_text('{"input_ids": [1, 2], "loss_\n{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    with pytest.raises(ValueError, match=r"line 1: not valid JSON \(") as info:
        load_examples(path)
    assert "truncated" not in str(info.value)


def test_peagle_pack_packs_only_new_complete_rows(tmp_path, capsys):
    from peagle.cli import main

    rows_path, folder = tmp_path / "rows.jsonl", tmp_path / "shards"
    data = examples(10, seed=3)
    rows = [dict(e, source="magpie" if i % 3 else "stdlib-code", cycle=i // 4) for i, e in enumerate(data)]
    lines = [json.dumps(r) + "\n" for r in rows]
    rows_path.write_text("".join(lines[:6]) + lines[6][:20])  # the last row is still being written
    assert main(["pack", str(rows_path), str(folder), "--target", "tiny"]) == 0
    manifest = read_manifest(folder)
    assert sorted(s["source"] for s in manifest["shards"]) == ["magpie", "stdlib-code"]
    assert all(s["rows"] == [0, 6] and s["rows_file"] == "rows.jsonl" for s in manifest["shards"])
    assert sum(s["examples"] for s in manifest["shards"]) == 6
    assert main(["pack", str(rows_path), str(folder)]) == 0  # nothing new
    assert len(read_manifest(folder)["shards"]) == 2
    rows_path.write_text("".join(lines))
    assert main(["pack", str(rows_path), str(folder)]) == 0
    manifest = read_manifest(folder)
    assert len(manifest["shards"]) == 4 and manifest["shards"][-1]["rows"] == [6, 10]
    packed = read_shards(folder)
    key = lambda e: e["input_ids"]  # noqa: E731
    assert sorted(packed, key=key) == sorted(
        ({"input_ids": e["input_ids"], "loss_mask": e["loss_mask"]} for e in data), key=key
    )
    assert "holds 10 examples" in capsys.readouterr().out

    # another run (or machine) regenerates cycles 0-2 under the same file name and adds cycle 3: only cycle 3 is
    # packed, the rows already in the folder never twice
    more = examples(4, seed=9)
    again = [
        dict(e, source="magpie", cycle=c, engine="vllm", prompt_set=2) for e, c in zip(more, (0, 2, 3, 3))
    ]
    del again[2]["prompt_set"]  # a row of an older run in the same shard: it used the first prompt set
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in again))
    assert main(["pack", str(rows_path), str(folder)]) == 0
    manifest = read_manifest(folder)
    assert manifest["shards"][-1]["cycles"] == [3, 3] and manifest["shards"][-1]["examples"] == 2
    assert manifest["shards"][-1]["engine"] == "vllm", "the manifest records what generated the rows"
    assert manifest["shards"][-1]["prompt_set"] == "1+2", "and with which prompt sets"
    assert "engine" not in manifest["shards"][0], "rows without an engine field (older runs) record none"
    # the data added since cycle 3: only the last shard's rows
    assert read_shards(folder, cycles=[(3, None)]) == [
        {"input_ids": e["input_ids"], "loss_mask": e["loss_mask"]}
        for e, c in zip(more, (0, 2, 3, 3))
        if c == 3
    ]
    assert (
        len(read_shards(folder, cycles=[(0, None)])) == 12 and read_shards(folder, cycles=[(4, None)]) == []
    )
    # whole shards inside a range (the first packing's shards hold cycles 0-1, the second's 1-2, the last 3);
    # a list of ranges joins them
    assert len(read_shards(folder, cycles=[(0, 1)])) == 6 and len(read_shards(folder, cycles=[(0, 2)])) == 10
    assert len(read_shards(folder, cycles=[(1, 3)])) == 6 and read_shards(folder, cycles=[(2, 3)]) == [
        {"input_ids": e["input_ids"], "loss_mask": e["loss_mask"]}
        for e, c in zip(more, (0, 2, 3, 3))
        if c == 3
    ]
    assert len(read_shards(folder, cycles=parse_cycle_ranges("3,0-1"))) == 8
    assert len(read_shards(folder)) == 12


def test_peagle_pack_never_packs_a_cycle_another_folder_of_the_dataset_holds(tmp_path):
    """grow_data.py's rows file holds every cycle, the held-out one too: packing it into `train/` must leave out
    the cycles `heldout/` (a sibling folder) holds."""
    from peagle.cli import main

    data = examples(6, seed=4)
    rows = [dict(e, source="magpie", cycle=i // 2) for i, e in enumerate(data)]  # cycles 0, 1, 2
    held = tmp_path / "heldout.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert main(["pack", str(held), str(tmp_path / "data" / "heldout"), "--target", "tiny"]) == 0
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["pack", str(rows_path), str(tmp_path / "data" / "train"), "--target", "tiny"]) == 0
    train = read_shards(tmp_path / "data" / "train")
    assert len(train) == 4
    assert not {tuple(e["input_ids"]) for e in train} & {tuple(r["input_ids"]) for r in rows[:2]}


def test_parse_cycle_ranges_reads_single_closed_and_open_ranges_and_names_a_bad_part():
    assert parse_cycle_ranges("78-93, 513-,7") == [(78, 93), (513, None), (7, 7)]
    for bad, says in (("9-3", "ends before"), ("a-3", "is not"), ("78-93,,1", "is not")):
        with pytest.raises(ValueError, match=says):
            parse_cycle_ranges(bad)


def test_dataset_folders_lists_the_shard_folders_of_a_dataset(tmp_path):
    """`peagle grow-data` skips and `peagle pack` refuses the cycles of every folder this lists: a held-out set added
    beside `train/` is covered without naming it anywhere."""
    from peagle.data.shards import dataset_folders

    for name in ("train", "heldout", "heldout-set3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(
            '{"format": "peagle-token-shards", "version": 1, "shards": []}'
        )
    (tmp_path / "notes").mkdir()  # no manifest: not a shard folder
    (tmp_path / "README.md").write_text("x")
    names = [os.path.basename(f) for f in dataset_folders(tmp_path)]
    assert names == ["heldout", "heldout-set3", "train"]
    assert [os.path.basename(f) for f in dataset_folders(tmp_path, exclude=tmp_path / "train")] == [
        "heldout",
        "heldout-set3",
    ]
    assert dataset_folders(tmp_path / "missing") == []


@pytest.mark.parametrize("bad", [2, -1, 0.5, "1", None])
def test_a_loss_mask_other_than_0_and_1_is_refused_naming_the_file_and_row(tmp_path, bad):
    """A mask of 2s was counted as more response tokens than the example has."""
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8, 9, 10], "loss_mask": [0, 1, bad]},
    ]
    path = tmp_path / "ex.jsonl"
    path.write_text(
        json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n"
    )  # a blank line still counts as a row
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}', line 3: loss_mask holds {re.escape(repr(bad))}"
    ):
        load_examples(path)
    rows[1]["loss_mask"][2] = True  # JSON true/false are 1/0
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_examples(path)[1]["loss_mask"] == [0, 1, True]


def test_a_shard_whose_loss_mask_holds_a_2_is_refused(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {
        "input_ids": np.array([5, 6, 7, 8], dtype=np.uint16),
        "offsets": np.array([0, 2, 4], dtype=np.int64),
        "loss_mask": np.array([0, 1, 1, 2], dtype=np.uint8),
    }
    save_file(tensors, str(tmp_path / "shard-00000.safetensors"))
    entry = {
        "file": "shard-00000.safetensors",
        "source": "x",
        "examples": 2,
        "tokens": 4,
        "response_tokens": 4,
    }
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": shards.FORMAT, "version": 1, "shards": [entry]})
    )
    with pytest.raises(ValueError, match=r"shard-00000.safetensors example 1: loss_mask holds 2"):
        read_shards(tmp_path)


def test_train_head_refuses_in_memory_examples_with_a_bad_loss_mask(tmp_path):
    from peagle.training import train_head, training_arguments

    target = make_target()
    bad = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 2, 1]}]
    args = training_arguments(tmp_path / "head" / "checkpoints", max_steps=1, use_cpu=True, progress=False)
    with pytest.raises(ValueError, match=r"row 0: loss_mask holds 2"):
        train_head(target, output_dir=tmp_path / "head", examples=bad, training_args=args)
