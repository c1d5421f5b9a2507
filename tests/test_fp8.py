"""FP8 heads (peagle.fp8): quantization error bounds, kernels against their fp32 emulation, the CUDA call
contracts (checked on CPU through fake CUDA tensors), fallbacks, save/load through safetensors, generate().

Tests marked `gpu` run the real scaled-matmul kernels and need an NVIDIA GPU of compute capability >= 8.9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel

import peagle
from helpers import BLOCK_PEAGLE, make_head, make_target
from peagle import fp8

E4M3_HALF_ULP = 2.0**-4  # round-to-nearest with 3 mantissa bits: |x - q| <= 2^-4 |x| for normal numbers
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # subnormal spacing 2^-9 (in units of the scale)

HAS_FP8_GPU = (
    torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)
)


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch):
    monkeypatch.setattr(fp8.linear, "_WARNED", set())
    monkeypatch.delenv(fp8.FALLBACK_ENV, raising=False)


def _heavy_tailed(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over ~6 decades so that normal and subnormal e4m3 ranges are both exercised
    return torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(shape, generator=g))


def _check_elementwise_bound(x, q, scale, block):
    deq = fp8.dequantize_fp8(q, scale, block)
    full_scale = fp8.dequantize_fp8(torch.ones_like(q, dtype=torch.float32).to(q.dtype), scale, block)
    err = (deq - x).abs()
    bound = E4M3_HALF_ULP * x.abs() + E4M3_SUBNORMAL_HALF_STEP * full_scale
    assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), float((err - bound).max())
    return err


# ---------------------------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("granularity,block", [("row", None), ("block", (32, 48)), ("block", (128, 128))])
def test_weight_quantization_error_bound(granularity, block):
    w = _heavy_tailed((200, 336))
    q, scale = fp8.quantize_weight(w, granularity, block or fp8.DEFAULT_BLOCK_SIZE)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert scale.dtype == torch.float32
    if block is None:
        assert scale.shape == (200, 1)
        amax = w.abs().amax(dim=1, keepdim=True)
        assert torch.allclose(scale, amax / 448.0)
    else:
        assert scale.shape == (-(-200 // block[0]), -(-336 // block[1]))
    err = _check_elementwise_bound(w, q, scale, block)
    # max-abs-scaled error: at most half an e4m3 ulp of the row/tile maximum
    tile_amax = fp8.dequantize_fp8(torch.ones_like(w).to(q.dtype), scale, block) * 448.0
    assert float((err / tile_amax).max()) <= E4M3_HALF_ULP
    # and the weight really went through 3-bit mantissas (not a lossless copy)
    assert float((err / w.abs().clamp_min(1e-30)).median()) > 2.0**-9


@pytest.mark.parametrize("block_k", [None, 32])
def test_activation_quantization_error_bound(block_k):
    x = _heavy_tailed((7, 96), seed=3).bfloat16()
    q, scale = fp8.quantize_activation(x, block_k)
    assert q.shape == x.shape and q.is_contiguous() and q.dtype == torch.float8_e4m3fn
    assert scale.shape == ((7, 1) if block_k is None else (7, 3))
    _check_elementwise_bound(x.float(), q, scale, None if block_k is None else (1, block_k))


def test_block_scales_isolate_an_outlier():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    w[0, 0] = 1e6  # row 0's scale becomes 1e6 / 448: its other entries fall below e4m3's smallest subnormal
    row_err = (fp8.dequantize_fp8(*fp8.quantize_weight(w, "row")) - w).abs()
    qb, sb = fp8.quantize_weight(w, "block", (16, 16))
    block_err = (fp8.dequantize_fp8(qb, sb, (16, 16)) - w).abs()
    rest = w[0, 16:].abs()
    assert float((row_err[0, 16:] / rest).median()) > 0.5  # row scaling: the outlier's row is wiped out
    assert bool((block_err[0, 16:] <= E4M3_HALF_ULP * rest + 1e-6).all())  # block scaling: other tiles intact


def test_zero_rows_and_partial_tiles():
    w = torch.randn(40, 48)
    w[3] = 0.0
    q, s = fp8.quantize_weight(w, "block", (16, 32))  # 40 = 2.5 tiles, 48 = 1.5 tiles
    assert s.shape == (3, 2)
    deq = fp8.dequantize_fp8(q, s, (16, 32))
    assert torch.equal(deq[3], torch.zeros(48))
    qr, sr = fp8.quantize_weight(w, "row")
    assert float(sr[3]) == 1.0 and torch.equal(fp8.dequantize_fp8(qr, sr)[3], torch.zeros(48))


def test_invalid_arguments_are_named():
    w = torch.randn(32, 32)
    with pytest.raises(ValueError, match="granularity is 'tensor'"):
        fp8.quantize_weight(w, "tensor")
    with pytest.raises(ValueError, match=r"block_size is \(128, 100\)"):
        fp8.quantize_weight(w, "block", (128, 100))
    with pytest.raises(ValueError, match="fallback is 'cpu'"):
        fp8.FP8Linear(32, 32, fallback="cpu")
    with pytest.raises(ValueError, match="needs block weight scales"):
        fp8.FP8Linear(32, 32, granularity="row", kernel="blockwise")
    with pytest.raises(ValueError, match="needs per-row weight scales"):
        fp8.FP8Linear(32, 32, granularity="block", kernel="rowwise")


# ---------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize(
    "kernel,block", [("rowwise", None), ("tensorwise", None), ("chunked", (32, 64)), ("chunked", (128, 128))]
)
def test_cpu_scaled_mm_kernels_match_emulation(kernel, block):
    """torch's CPU build implements scaled_mm for row-wise/tensor-wise scales: the same calls as on the GPU."""
    if not fp8.kernel_available(kernel, "cpu"):
        pytest.skip(f"torch {torch.__version__} has no CPU scaled_mm for {kernel}")
    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, s = fp8.quantize_weight(w, "row" if block is None else "block", block or fp8.DEFAULT_BLOCK_SIZE)
    got = fp8.fp8_matmul(x, q, s, block, kernel, torch.float32)
    ref = fp8.fp8_matmul(x, q, s, block, "emulate", torch.float32)
    tol = 1e-2 if kernel == "rowwise" else 1e-4  # rowwise returns bf16
    assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())
    exact = x.float() @ w.t()
    assert float((got - exact).abs().max()) <= 0.1 * float(exact.abs().max())


@pytest.mark.parametrize("kernel", ["rowwise", "tensorwise", "blockwise", "chunked"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_cuda_call_contracts_with_fake_cuda_tensors(kernel, m, monkeypatch):
    """Run each kernel's exact call on fake CUDA tensors: torch's meta checks for CUDA (row-major A,
    column-major B, 16-aligned K/N, scale shapes and strides of each recipe) run on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if kernel == "blockwise" and not fp8.kernels._HAS_SCALED_MM_V2:
        pytest.skip("block-wise scaling needs torch.nn.functional.scaled_mm")
    monkeypatch.setattr(fp8.kernels, "_ONES", {})  # keep fake tensors out of the module-level cache
    block = (128, 128) if kernel in ("blockwise", "chunked") else None
    with FakeTensorMode():
        x = torch.empty(m, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(384, 256, device="cuda", dtype=torch.bfloat16)
        q, s = fp8.quantize_weight(w, "row" if block is None else "block")
        y = fp8.fp8_matmul(x, q, s, block, kernel)
        assert y.shape == (m, 384) and y.dtype == torch.bfloat16 and y.device.type == "cuda"


def test_fake_cuda_contracts_catch_a_wrong_layout(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(fp8.kernels, "_ONES", {})
    with FakeTensorMode():
        xq = torch.empty(4, 256, device="cuda", dtype=torch.float8_e4m3fn)
        wq = torch.empty(256, 256, device="cuda", dtype=torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        with pytest.raises(RuntimeError, match="col_major"):
            # wq not transposed
            fp8.kernels._scaled_mm(xq, wq, one, "TensorWise", one, "TensorWise", torch.float32)


# ---------------------------------------------------------------------------------------------- the module
def test_forward_without_fp8_support_raises_with_the_fix():
    layer = fp8.FP8Linear.from_linear(nn.Linear(32, 48))
    with pytest.raises(RuntimeError) as info:
        layer(torch.randn(2, 32))
    msg = str(info.value)
    assert "cpu" in msg and "8.9" in msg and "fallback='dequantize'" in msg


@pytest.mark.parametrize("mode", ["dequantize", "emulate"])
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_fallback_forward_is_close_and_warns_once(mode, granularity):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = fp8.FP8Linear.from_linear(linear, granularity, (32, 32), fallback=mode)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=f"fallback='{mode}'"):
            y = layer(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y2 = layer(x)
        ref = linear(x)
    assert torch.equal(y, y2) and y.shape == (3, 5, 96) and y.dtype == x.dtype
    rel = float((y - ref).abs().max() / ref.abs().max())
    assert 0 < rel < 0.06
    if mode == "dequantize":
        assert torch.allclose(y, nn.functional.linear(x, layer.dequantized_weight(), linear.bias), atol=1e-6)


def test_gpu_below_compute_capability_8_9_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.version, "hip", None)
    fp8.kernels._device_support.cache_clear()
    try:
        ok, why = fp8.fp8_device_support("cuda:0")
        assert not ok and "A100" in why and "compute capability 8.0 < 8.9" in why
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        fp8.kernels._device_support.cache_clear()
        assert fp8.fp8_device_support("cuda:0")[0]
    finally:
        fp8.kernels._device_support.cache_clear()


def test_fallback_from_environment(monkeypatch):
    layer = fp8.FP8Linear.from_linear(nn.Linear(32, 32))
    monkeypatch.setenv(fp8.FALLBACK_ENV, "dequantize")
    with pytest.warns(RuntimeWarning):
        assert layer(torch.randn(2, 32)).shape == (2, 32)
    monkeypatch.setenv(fp8.FALLBACK_ENV, "fast")
    with pytest.raises(ValueError, match="fallback is 'fast'"):
        layer(torch.randn(2, 32))


def test_dtype_casts_keep_fp8_storage():
    layer = fp8.FP8Linear.from_linear(nn.Linear(32, 48), "block", (16, 16))
    w, s = layer.weight.clone(), layer.weight_scale.clone()
    for cast in (
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.double(),
    ):
        cast(layer)
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(
            layer.weight_scale, s
        )
    assert layer.bias.dtype == torch.float64  # the bias follows the cast


# ---------------------------------------------------------------------------------------------- heads
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _inputs(head, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (1, n), generator=g)
    feats = torch.randn(1, n, 3 * head.config.target_hidden_size, generator=g)
    return ids, feats


def test_quantize_head_swaps_the_right_layers(tiny_head):
    ref_embed = tiny_head.embed_tokens.weight.clone()
    fp8.quantize_head(tiny_head, fallback="dequantize")
    mods = fp8.fp8_modules(tiny_head)
    expected = {"fc"} | {
        f"layers.{i}.{part}.{p}"
        for i in range(2)
        for part, ps in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
        for p in ps
    }
    assert set(mods) == expected
    assert type(tiny_head.lm_head) is nn.Linear and type(tiny_head.embed_tokens) is nn.Embedding
    assert torch.equal(tiny_head.embed_tokens.weight, ref_embed)
    record = tiny_head.config.peagle_fp8
    assert record["granularity"] == "row" and record["modules"] == sorted(expected)
    assert record["format"] == "float8_e4m3fn" and record["activation_scheme"] == "dynamic"
    with pytest.raises(ValueError, match="already FP8-quantized"):
        fp8.quantize_head(tiny_head)


def test_quantize_head_with_lm_head(tiny_target):
    head = make_head(tiny_target)
    fp8.quantize_head(head, "block", (32, 32), include_lm_head=True)
    assert isinstance(head.lm_head, fp8.FP8Linear) and "lm_head" in head.config.peagle_fp8["modules"]
    assert head.config.peagle_fp8["block_size"] == [32, 32]


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_quantized_head_forward_is_close(tiny_target, granularity):
    head = make_head(tiny_target)
    ids, feats = _inputs(head)
    with torch.no_grad():
        ref = head(ids, target_hidden_states=feats).logits
        fp8.quantize_head(head, granularity, (32, 32), fallback="emulate")
        with pytest.warns(RuntimeWarning, match="emulate"):
            out = head(ids, target_hidden_states=feats).logits
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert 0 < rel < 0.1
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.parametrize(
    "granularity,block,lm_head",
    [("row", None, False), ("block", (32, 32), True), ("block", (32, 64), False)],
)
def test_save_and_load_round_trip(tiny_target, tmp_path, granularity, block, lm_head):
    head = make_head(tiny_target)
    fp8.quantize_head(head, granularity, block or fp8.DEFAULT_BLOCK_SIZE, include_lm_head=lm_head)
    fp8.set_fp8_fallback(head, "dequantize")
    head.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "config.json").read_text())
    record = head.config.peagle_fp8
    assert "peagle_fp8" not in saved and not (tmp_path / "fp8.py").exists()  # the ecosystem's format only
    dense = ["lm_head"] if not lm_head else []
    assert saved["quantization_config"] == fp8.quantization_config(record, dense)
    assert saved["auto_map"]["AutoModel"] == "modeling_peagle.PEagleDrafter"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in record["modules"]:
            assert f.get_slice(f"{name}.weight").get_dtype() == "F8_E4M3"
            assert f.get_slice(f"{name}.weight_scale").get_dtype() == "F32"
        assert f.get_slice("embed_tokens.weight").get_dtype() == "F32"
    assert ("lm_head.weight_scale" in keys) == lm_head

    for loaded in (
        peagle.PEagleDrafter.from_pretrained(tmp_path),
        peagle.PEagleDrafter.from_pretrained(tmp_path, dtype=torch.bfloat16),
        AutoModel.from_pretrained(tmp_path),
    ):
        mods, orig = fp8.fp8_modules(loaded), fp8.fp8_modules(head)
        assert set(mods) == set(orig) and loaded.config.peagle_fp8["modules"] == record["modules"]
        assert not hasattr(
            loaded.config, "quantization_config"
        )  # peagle's layers, not transformers' quantizer
        for name, m in mods.items():
            assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
            assert m.block_size == orig[name].block_size
            assert torch.equal(m.weight.view(torch.uint8), orig[name].weight.view(torch.uint8)), name
            assert torch.equal(m.weight_scale, orig[name].weight_scale), name

    loaded = peagle.PEagleDrafter.from_pretrained(tmp_path)
    ids, feats = _inputs(head)
    with pytest.raises(RuntimeError, match="fallback"):
        loaded(ids, target_hidden_states=feats)  # a loaded head gets no implicit fallback
    fp8.set_fp8_fallback(loaded, "dequantize")
    with torch.no_grad(), pytest.warns(RuntimeWarning):
        assert torch.equal(
            loaded(ids, target_hidden_states=feats).logits, head(ids, target_hidden_states=feats).logits
        )


def test_dequantize_head(tiny_target):
    head = make_head(tiny_target)
    fp8.quantize_head(head, "block", (32, 32), fallback="dequantize")
    ids, feats = _inputs(head)
    with torch.no_grad(), pytest.warns(RuntimeWarning):
        quantized = head(ids, target_hidden_states=feats).logits
    fp8.dequantize_head(head)
    assert not fp8.fp8_modules(head) and not hasattr(head.config, "peagle_fp8")
    assert type(head.fc) is nn.Linear and head.fc.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(head(ids, target_hidden_states=feats).logits, quantized, atol=1e-5)


def test_fp8_summary_reports_kernels(tiny_head):
    fp8.quantize_head(tiny_head)
    summary = fp8.fp8_summary(tiny_head, "cpu")
    assert summary["layers"] == 15 and summary["kernels"] == {"unsupported": 15}
    fp8.set_fp8_fallback(tiny_head, "emulate")
    assert fp8.fp8_summary(tiny_head, "cpu")["kernels"] == {"emulate": 15}


# ---------------------------------------------------------------------------------------------- generate()
class _Oracle:
    """Forward hook pushing each drafting slot's logits toward the reference continuation with probability p,
    so that rounds accept some drafts and reject others (a random head alone would draft almost nothing right)."""

    def __init__(self, head, reference, p=0.7):
        self.reference, self.p = reference[0].tolist(), p
        self.gen = torch.Generator().manual_seed(0)
        draft_ids = (torch.arange(head.config.draft_vocab_size) + head.d2t).tolist()
        self.index = {t: i for i, t in enumerate(draft_ids)}
        self.handle = head.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        k = out.logits.shape[1]
        logits = out.logits.clone()
        for j, q in enumerate(kwargs["position_ids"][0, -k:].tolist()):
            if q + 2 < len(self.reference) and torch.rand((), generator=self.gen) < self.p:
                logits[0, j, self.index[self.reference[q + 2]]] = logits[0, j].max() + 10.0
        out.logits = logits


def _generate_lossless(target, head, device="cpu", new=24):
    ids = torch.randint(3, 120, (1, 7), generator=torch.Generator().manual_seed(5)).to(device)
    plain = target.generate(ids, do_sample=False, max_new_tokens=new)
    oracle = _Oracle(head, plain)
    try:
        out = target.generate(
            ids, do_sample=False, max_new_tokens=new, assistant_model=head, num_assistant_tokens=4
        )
    finally:
        oracle.handle.remove()
    assert torch.equal(out, plain)
    stats = head.last_generation_stats
    assert stats.rounds > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    return stats


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_generate_with_fp8_head_is_lossless_in_fallback(granularity):
    target = make_target(num_hidden_layers=4, eos_token_id=None)
    head = fp8.quantize_head(make_head(target), granularity, (32, 32), fallback="emulate")
    with pytest.warns(RuntimeWarning):
        _generate_lossless(target, head)


def test_generate_with_fp8_target_in_memory():
    """`quantize_linears` works on a target too (in memory): speculative output equals the FP8 target's own."""
    target = make_target(num_hidden_layers=4, eos_token_id=None)
    names = fp8.quantize_linears(target, fallback="dequantize", include=lambda n, m: n != "lm_head")
    assert len(names) == 4 * 7
    head = make_head(target)
    with pytest.warns(RuntimeWarning):
        _generate_lossless(target, head)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs an NVIDIA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("granularity,k,n", [("row", 576, 1536), ("block", 576, 1536), ("block", 512, 1024)])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_gpu_fp8_linear_matches_bf16(granularity, k, n, m):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = fp8.FP8Linear.from_linear(linear, granularity)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    kernel = layer.resolve_kernel(x.device)
    assert kernel in ("rowwise", "tensorwise", "blockwise", "chunked")
    if granularity == "block" and k % 128 == 0 and fp8.kernel_available("blockwise", "cuda"):
        assert kernel == "blockwise"
    with torch.no_grad():
        y, ref = layer(x), linear(x)
        emu = fp8.fp8_matmul(x, layer.weight, layer.weight_scale, layer.block_size, "emulate") + linear.bias
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert (
        float((y.float() - ref.float()).abs().max() / ref.float().abs().max()) < 0.07
    )  # CPU emulation: <= 0.04
    assert float((y.float() - emu.float()).abs().max() / emu.float().abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs an NVIDIA GPU with compute capability >= 8.9")
def test_gpu_kernel_probes():
    info = fp8.fp8_kernel_info("cuda")
    assert info["fp8_supported"]
    assert info["kernels"]["rowwise"] or info["kernels"]["tensorwise"], info
    assert info["kernels"]["chunked"] == info["kernels"]["tensorwise"], info


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs an NVIDIA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_gpu_quantized_head_drafts_losslessly(granularity):
    target = make_target(num_hidden_layers=4, eos_token_id=None).cuda()  # fp32 target: exact verification
    head = make_head(target).to("cuda", torch.bfloat16)
    fp8.quantize_head(head, granularity)
    kernels = fp8.fp8_summary(head, "cuda")["kernels"]
    assert set(kernels) <= {"rowwise", "tensorwise", "blockwise", "chunked"}, kernels
    _generate_lossless(target, head, device="cuda")
    assert not fp8.linear._WARNED  # no fallback ran: the drafts came from the FP8 kernels


_LAZY_FP8 = """
import sys

import peagle

assert "peagle.fp8" not in sys.modules  # `import peagle` does not import the FP8 code
head = peagle.PEagleDrafter.from_pretrained(sys.argv[1])  # peagle.formats imports it for an FP8 head
assert "peagle.fp8" in sys.modules
assert type(head.fc).__name__ == "FP8Linear" and head.fc.weight.dtype.itemsize == 1
assert peagle.quantize_head is sys.modules["peagle.fp8"].quantize_head
print("OK")
"""


@pytest.mark.slow
def test_fp8_is_imported_lazily_and_on_demand(tiny_head, tmp_path):
    fp8.quantize_head(tiny_head)
    tiny_head.save_pretrained(tmp_path / "head")
    script = tmp_path / "lazy.py"
    script.write_text(_LAZY_FP8)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "head")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_head_without_fp8_builder_is_refused(tiny_head, monkeypatch):
    fp8.quantize_head(tiny_head)
    monkeypatch.setattr(peagle.PEagleDrafter, "_config_extensions", {})
    with pytest.raises(ValueError, match=r"config\.peagle_fp8 is set.*import peagle\.fp8"):
        peagle.PEagleDrafter(tiny_head.config)


# ---------------------------------------------------------------------------------------------- checkpoint format
def _fp8_head(target, granularity="row", block=None):
    head = make_head(target)
    return fp8.quantize_head(head, granularity, block or fp8.DEFAULT_BLOCK_SIZE, fallback="dequantize")


def _same_fp8_layers(loaded, head):
    mods, orig = fp8.fp8_modules(loaded), fp8.fp8_modules(head)
    assert set(mods) == set(orig) and mods
    for name, m in mods.items():
        assert m.block_size == orig[name].block_size, name
        assert torch.equal(m.weight.view(torch.uint8), orig[name].weight.view(torch.uint8)), name
        assert torch.equal(m.weight_scale, orig[name].weight_scale), name


def test_heads_in_the_earlier_peagle_layout_still_load(tiny_target, tmp_path):
    """Heads saved before the compressed-tensors format: `peagle_fp8` in config.json, no quantization_config."""
    head = _fp8_head(tiny_target, "block", (32, 32))
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    config["peagle_fp8"] = head.config.peagle_fp8
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = peagle.PEagleDrafter.from_pretrained(tmp_path)
    _same_fp8_layers(loaded, head)
    assert loaded.config.peagle_fp8 == head.config.peagle_fp8


@pytest.mark.parametrize("granularity,block", [("row", None), ("block", [32, 64])])
def test_quantization_config_is_read_back_as_the_record(granularity, block):
    record = {"granularity": granularity, "block_size": block}
    qc = fp8.quantization_config(record, ["lm_head", "layers.1.mlp.down_proj"])
    group = qc["config_groups"]["group_0"]
    assert (qc["quant_method"], qc["format"], group["targets"]) == (
        "compressed-tensors",
        "float-quantized",
        ["Linear"],
    )
    assert group["weights"]["strategy"] == ("channel" if block is None else "block")
    assert group["input_activations"]["dynamic"] is True
    back = fp8.fp8_record(qc, {"layers.1.mlp.down_proj": "renamed"})
    assert (back["granularity"], back["block_size"]) == (granularity, block)
    assert back["ignore"] == ["lm_head", "renamed"] and back["targets"] == ["Linear"]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda qc: qc["config_groups"].update(group_1={}), "2 config groups"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int"), "weights are 'int' 8-bit"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy 'tensor'"),
        (
            lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
            "input_activations",
        ),
        (
            lambda qc: qc["config_groups"]["group_0"].update(format="pack-quantized"),
            "format 'pack-quantized'",
        ),
    ],
)
def test_other_compressed_tensors_schemes_are_refused_by_field(tiny_target, tmp_path, change, message):
    head = _fp8_head(tiny_target)
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    change(config["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: quantization_config .*{message}"):
        peagle.PEagleDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quant_method 'fp8'"):  # transformers' own method: not this reader's
        fp8.fp8_record({**config["quantization_config"], "quant_method": "fp8"})


def test_ignore_patterns_keep_layers_dense(tiny_head):
    """llm-compressor writes `re:` patterns in `ignore`; every other linear layer is FP8 (`targets: Linear`)."""
    config = tiny_head.config
    config.peagle_fp8 = fp8.fp8_record(
        fp8.quantization_config({"granularity": "row"}, ["re:.*lm_head", r"re:layers\.1\..*", "fc"])
    )
    head = peagle.PEagleDrafter(config)
    names = sorted(fp8.fp8_modules(head))
    assert names == [f"layers.0.{n}" for n in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")] + [
        f"layers.0.self_attn.{n}_proj" for n in "koqv"
    ]
    assert head.config.peagle_fp8["modules"] == names and "ignore" not in head.config.peagle_fp8


@pytest.mark.parametrize("layout,layer0", [("vllm", "midlayer."), ("speculators", "layers.0.")])
def test_fp8_heads_export_with_their_quantization_config(tiny_target, tmp_path, layout, layer0):
    """vLLM and speculators exports carry the FP8 tensors and the compressed-tensors config vLLM reads."""
    head = _fp8_head(tiny_target)
    out = peagle.export(head, tmp_path / layout, layout=layout, target_model=tiny_target)
    config = json.loads((out / "config.json").read_text())
    dense = ["lm_head"] + (["verifier_lm_head"] if layout == "speculators" else [])
    assert config["quantization_config"] == fp8.quantization_config(head.config.peagle_fp8, dense)
    assert "peagle_fp8" not in config and config["torch_dtype"] == "float32"  # not the e4m3 storage dtype
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice(f"{layer0}self_attn.q_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice(f"{layer0}self_attn.q_proj.weight_scale").get_dtype() == "F32"
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"
    loaded = fp8.set_fp8_fallback(peagle.load_head(out), "dequantize")
    _same_fp8_layers(loaded, head)
    ids, feats = _inputs(head)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert torch.equal(
            loaded(ids, target_hidden_states=feats).logits, head(ids, target_hidden_states=feats).logits
        )


_TRANSFORMERS_LOAD_WITHOUT_PEAGLE = (
    BLOCK_PEAGLE
    + """
import torch
from transformers import AutoModel, CompressedTensorsConfig

torch.set_num_threads(1)  # the reference logits were computed with the suite's single thread
folder, ref_file = sys.argv[1:3]
ref = torch.load(ref_file)
dense = CompressedTensorsConfig(dequantize=True)
for name, kwargs in (("dequantized", {"quantization_config": dense}), ("compressed", {})):
    head = AutoModel.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()
    assert type(head).__module__.startswith("transformers_modules"), type(head).__module__
    for layer, weight in ref["weights"].items():
        got = head.get_submodule(layer).weight
        if name == "dequantized":
            assert got.dtype == torch.float32 and torch.equal(got, weight), layer
        else:  # kept in e4m3 with its scale; compressed-tensors quantizes activations on the fly
            assert got.dtype == torch.float8_e4m3fn and hasattr(head.get_submodule(layer), "weight_scale"), layer
    with torch.no_grad():
        logits = head(ref["ids"], target_hidden_states=ref["feats"]).logits
    torch.testing.assert_close(logits, ref[name], rtol=1e-4, atol=1e-5)
assert "peagle" not in sys.modules
print("OK")
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("granularity,block", [("row", None), ("block", (32, 32))])
def test_transformers_loads_a_saved_fp8_head(tiny_target, tmp_path, granularity, block):
    """transformers' compressed-tensors quantizer loads the saved head (remote code, peagle not importable):
    `dequantize=True` gives peagle's dequantized weights and logits; the default keeps e4m3 weights and
    fake-quantizes activations, which is peagle's `emulate` fallback."""
    pytest.importorskip(
        "compressed_tensors", reason="transformers reads this format through compressed-tensors"
    )
    head = _fp8_head(tiny_target, granularity, block)
    head.save_pretrained(tmp_path / "head")
    ids, feats = _inputs(head)
    ref = {"ids": ids, "feats": feats, "weights": {}}
    for name, module in fp8.fp8_modules(head).items():
        ref["weights"][name] = module.dequantized_weight(torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for mode, key in (("dequantize", "dequantized"), ("emulate", "compressed")):
            ref[key] = fp8.set_fp8_fallback(head, mode)(ids, target_hidden_states=feats).logits
    torch.save(ref, tmp_path / "ref.pt")
    script = tmp_path / "load.py"
    script.write_text(_TRANSFORMERS_LOAD_WITHOUT_PEAGLE)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "head"), str(tmp_path / "ref.pt")],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_partial_block_tiles_warn_on_save_and_are_not_exported(tiny_target, tmp_path):
    """compressed-tensors and vLLM read block scales only when the block divides every layer (64 / 128 here)."""
    head = _fp8_head(tiny_target, "block", (48, 32))
    with pytest.warns(UserWarning, match=r"fc \(64 x 192, block \(48, 32\)\), .*partial block tiles"):
        head.save_pretrained(tmp_path / "head")
    _same_fp8_layers(peagle.PEagleDrafter.from_pretrained(tmp_path / "head"), head)  # peagle still reads it
    with pytest.raises(ValueError, match="partial block tiles.*granularity='row'"):
        peagle.export(head, tmp_path / "vllm", layout="vllm", target_model=tiny_target)
    assert not (tmp_path / "vllm").exists()  # refused before anything was written
