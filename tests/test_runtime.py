"""The dtype rule (`peagle.runtime`): bfloat16 only where the machine computes it natively."""

import pytest
import torch

from peagle import runtime


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Pretend the CPU does (True) or does not (False) run bf16 natively."""

    def set_native(native: bool):
        monkeypatch.setattr(runtime, "_cpu_native_bf16", lambda: native)

    return set_native


def test_auto_is_float32_without_native_bf16(cpu_bf16):
    cpu_bf16(False)
    assert not runtime.native_bf16("cpu")
    assert runtime.preferred_dtype("cpu") is torch.float32
    assert runtime.resolve_dtype("auto", "cpu") is torch.float32
    assert runtime.resolve_dtype(None, "cpu") is torch.float32
    assert runtime.resolve_dtype_name("auto", "cpu") == "float32"


def test_auto_is_bfloat16_with_native_bf16(cpu_bf16):
    cpu_bf16(True)
    assert runtime.resolve_dtype("auto", "cpu") is torch.bfloat16


def test_explicit_dtypes_win_over_the_machine(cpu_bf16):
    cpu_bf16(False)
    assert runtime.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert runtime.resolve_dtype(torch.float16) is torch.float16
    cpu_bf16(True)
    assert runtime.resolve_dtype("float32", "cpu") is torch.float32


@pytest.mark.parametrize("bad", ["int8", "bf16x", "long"])
def test_unknown_dtype_names_are_refused(bad):
    with pytest.raises(ValueError, match="unknown dtype"):
        runtime.resolve_dtype(bad)


def test_the_probe_answers_a_bool_on_this_machine():
    runtime._cpu_native_bf16.cache_clear()
    assert isinstance(runtime._cpu_native_bf16(), bool)


def test_demo_runs_the_head_in_float32_without_native_bf16(cpu_bf16, tmp_path, capsys):
    """An AVX2-only CPU computes bf16 many times slower than fp32: the demo's default head dtype follows the rule."""
    from helpers import make_head, make_target, tiny_tokenizer
    from peagle.demo import run_demo

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    make_head(target).save_pretrained(tmp_path / "head")
    for native, want in ((False, "torch.float32"), (True, "torch.bfloat16")):
        cpu_bf16(native)
        run_demo(
            max_new_tokens=3, prompts=("hi",), target=str(tmp_path / "target"), head=str(tmp_path / "head")
        )
        assert f"head {want}" in capsys.readouterr().out
