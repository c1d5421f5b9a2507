"""Bad input, fourth round (issue #80): weights that are useless although their shapes are right, a Hub repo id or
upload folder a later step refuses, token ids outside the vocabulary, lengths that are not whole, a mask of another
shape, and the default head asked for without its distribution."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file, save_file

import peagle
from helpers import make_head, make_target, prompt_ids
from peagle import PEagleDrafter
from test_formats import write_eagle3_research


# ------------------------------------------------------------------------------ weights that hold NaN or inf
def _poison(folder, value: float) -> str:
    """Write `value` into one entry of the first `fc` tensor of `folder`'s weights; returns the tensor's name."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = next(k for k in sorted(tensors) if "fc" in k)
    tensors[name][0, 0] = value
    save_file(tensors, file, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("layout", ["peagle", "vllm", "speculators", "eagle3"])
@pytest.mark.parametrize("value, word", [(float("nan"), "1 NaN"), (float("inf"), "1 inf")])
def test_a_head_whose_weights_hold_nan_or_inf_is_refused_in_every_layout(tmp_path, layout, value, word):
    target = make_target()
    folder = tmp_path / layout
    if layout == "eagle3":
        write_eagle3_research(folder)
    else:
        peagle.export(make_head(target), folder, layout=layout, target_model=target)
    PEagleDrafter.from_pretrained(folder, target_model=target)  # the clean head loads
    name = _poison(folder, value)
    with pytest.raises(ValueError, match="hold NaN or inf") as err:
        PEagleDrafter.from_pretrained(folder, target_model=target)
    assert f"{name!r}: {word} of" in str(err.value) and str(folder) in str(err.value)


def test_a_head_with_nan_weights_is_neither_exported_nor_uploaded(tmp_path, tiny_target, tiny_head):
    from peagle.integrations.hub import prepare_upload_folder

    with torch.no_grad():
        tiny_head.norm.weight[3] = float("nan")
    for layout in ("vllm", "peagle"):
        with pytest.raises(ValueError, match=r"the head to export: tensors \['norm.weight'\] hold NaN"):
            peagle.export(tiny_head, tmp_path / layout, layout=layout, target_model=tiny_target)
        assert not (tmp_path / layout).exists()
    with pytest.raises(ValueError, match=r"the head to upload: tensors \['norm.weight'\]"):
        prepare_upload_folder(tiny_head, tmp_path / "up", repo_id="org/name")
    assert not (tmp_path / "up").exists()


def test_generate_refuses_a_head_with_nan_weights_and_reads_a_head_once(tiny_target, tiny_head, monkeypatch):
    reads = []
    original = PEagleDrafter.nonfinite_tensors
    monkeypatch.setattr(PEagleDrafter, "nonfinite_tensors", lambda self: reads.append(1) or original(self))
    ids = prompt_ids(0, 6)
    for _ in range(2):
        tiny_target.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=tiny_head)
    assert len(reads) == 1  # a head object passed once is not read again
    tiny_head.float()  # a cast may overflow: read again on the next call
    tiny_target.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=tiny_head)
    assert len(reads) == 2
    broken = make_head(tiny_target)
    with torch.no_grad():
        broken.fc.weight[1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"assistant_model .*\['fc.weight'\] hold NaN or inf .*1 inf of"):
        tiny_target.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=broken)


# ------------------------------------------------------------------------------ Hub repo ids and upload folders
@pytest.mark.parametrize("repo_id", ["not a/valid repo!!", "a/b/c", "org/x--y", "org/x.git", ""])
def test_push_refuses_a_repo_id_the_hub_refuses_before_anything_is_read_or_written(
    tmp_path, capsys, monkeypatch, tiny_head, repo_id
):
    """It used to exit 0 and write an upload folder (and card) for an id the Hub would refuse."""
    from peagle.cli import main

    tiny_head.save_pretrained(tmp_path / "head")
    monkeypatch.setattr(peagle.formats, "load_head", lambda *a, **k: pytest.fail("the head was loaded"))
    out = tmp_path / "up"
    with pytest.raises(SystemExit) as err:
        main(["push", str(tmp_path / "head"), repo_id, "--prepare_only", str(out)])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert f"repo_id is {repo_id!r}, which the Hub refuses" in message and "namespace/name" in message
    assert not out.exists()


def test_python_uploads_refuse_a_bad_repo_id_before_anything_is_written(tmp_path, tiny_head, monkeypatch):
    from huggingface_hub import HfApi

    from peagle.integrations.hub import prepare_upload_folder

    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("a repo was created"))
    with pytest.raises(ValueError, match=r"repo_id is 'not a/valid repo!!', which the Hub refuses"):
        tiny_head.push_to_hub("not a/valid repo!!")
    with pytest.raises(ValueError, match="repo_id is 'a/b/c'"):
        prepare_upload_folder(tiny_head, tmp_path / "up", repo_id="a/b/c")
    assert not (tmp_path / "up").exists()


def test_push_refuses_an_upload_folder_it_cannot_write_before_loading(
    tmp_path, capsys, monkeypatch, tiny_head
):
    """An empty --prepare_only used to mean "upload" (a falsy folder), and a folder below a file failed late."""
    from huggingface_hub import HfApi

    from peagle.cli import main

    tiny_head.save_pretrained(tmp_path / "head")
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("a repo was created"))
    file = tmp_path / "a_file"
    file.write_text("x")
    cases = {"": "the upload folder is ''", str(file): "is a file", str(file / "sub"): "a_file is a file"}
    for folder, words in cases.items():
        with pytest.raises(SystemExit) as err:
            main(["push", str(tmp_path / "head"), "org/name", "--prepare_only", folder])
        assert err.value.code == 2 and words in capsys.readouterr().err
    assert file.read_text() == "x"


# ------------------------------------------------------------------------------ token ids, lengths, masks
def _early_end(target):
    """Two prompts and an eos id the first row generates at its second step (so it ends early and is padded)."""
    ids = torch.cat([prompt_ids(0, 6), prompt_ids(1, 6)])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    return ids, int(plain[0, 7])


@pytest.mark.parametrize("pad", [500, -1, 128])
def test_pad_token_id_outside_the_vocabulary_is_refused(tiny_target, tiny_head, pad):
    ids, eos = _early_end(tiny_target)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    with pytest.raises(IndexError):  # plain generate() fails on it once a row is padded
        tiny_target.generate(ids, **kw)
    with pytest.raises(ValueError, match=rf"pad_token_id is {pad}; expected token ids in \[0, 128\)"):
        tiny_target.generate(ids, assistant_model=tiny_head, **kw)


@pytest.mark.parametrize("eos, shown", [(500, "500"), ([2, -1], r"\[2, -1\]")])
def test_eos_token_id_outside_the_vocabulary_is_refused(tiny_target, tiny_head, eos, shown):
    with pytest.raises(ValueError, match=rf"eos_token_id is {shown}; expected token ids in \[0, 128\)"):
        tiny_target.generate(prompt_ids(0, 6), max_new_tokens=4, eos_token_id=eos, assistant_model=tiny_head)


def test_token_ids_inside_the_vocabulary_still_decode_like_plain(tiny_target, tiny_head):
    ids, eos = _early_end(tiny_target)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=127, eos_token_id=[eos, 5])
    assert torch.equal(
        tiny_target.generate(ids, assistant_model=tiny_head, **kw), tiny_target.generate(ids, **kw)
    )


@pytest.mark.parametrize(
    "kw, name", [({"max_new_tokens": 2.5}, "max_new_tokens"), ({"max_length": 8.5}, "max_length")]
)
def test_lengths_that_are_not_whole_are_refused(tiny_target, tiny_head, kw, name):
    """Plain generate() runs to the length above 8.5 (9 tokens); the head's loop used to stop at 8."""
    ids = prompt_ids(0, 6)
    assert tiny_target.generate(ids, do_sample=False, **kw).shape[1] == 9
    with pytest.raises(ValueError, match=rf"{name} is {list(kw.values())[0]}; expected a whole number"):
        tiny_target.generate(ids, do_sample=False, assistant_model=tiny_head, **kw)
    whole = {k: float(int(v)) for k, v in kw.items()}  # 2.0 / 8.0 are whole: as plain
    assert torch.equal(
        tiny_target.generate(ids, do_sample=False, assistant_model=tiny_head, **whole),
        tiny_target.generate(ids, do_sample=False, **whole),
    )


@pytest.mark.parametrize("shape", [(2, 6), (1, 3), (1, 9)])
def test_an_attention_mask_of_another_shape_is_refused(tiny_target, tiny_head, shape):
    """The head's loop used to ignore such a mask and return output; plain generate() fails on most of them."""
    with pytest.raises(
        ValueError, match=rf"attention_mask has shape \({shape[0]}, {shape[1]}\); expected \(1, 6\)"
    ):
        tiny_target.generate(
            prompt_ids(0, 6),
            attention_mask=torch.ones(shape, dtype=torch.long),
            max_new_tokens=3,
            assistant_model=tiny_head,
        )


# ------------------------------------------------------------------------------ the default head, not installed
@pytest.fixture
def without_heads(monkeypatch):
    """The heads distribution missing, and a default target that must not be loaded (converted) first."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "peagle_heads" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    loaded = []
    monkeypatch.setattr(peagle.targets, "load_default_target", lambda *a, **k: loaded.append("default"))
    monkeypatch.setattr(peagle.targets, "load_target", lambda *a, **k: loaded.append("target"))
    return loaded


def test_load_default_drafter_without_the_heads_fails_before_the_target_loads(without_heads):
    with pytest.raises(
        ModuleNotFoundError, match=r"no package peagle_heads .*pip install --no-deps -e \./heads"
    ):
        peagle.load_default_drafter()
    assert without_heads == []


def test_an_unknown_default_head_kind_fails_before_the_target_loads(monkeypatch):
    loaded = []
    monkeypatch.setattr(peagle.targets, "load_default_target", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match=r"kind is 'medusa'; expected one of \['eagle3', 'peagle'\]"):
        peagle.load_default_drafter(kind="medusa")
    assert loaded == []


def test_demo_without_the_heads_fails_before_the_target_loads(without_heads):
    from peagle.cli import main

    with pytest.raises(SystemExit, match=r"peagle demo: error: no package peagle_heads .*pip install"):
        main(["demo", "--max_new_tokens", "4"])
    assert without_heads == []
