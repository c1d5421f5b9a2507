"""FP8 heads in compressed-tensors' float8 format, read by the peers that run on this CPU (docs/fp8.md section 3).

- compressed-tensors 0.17's own loader (`QuantizationConfig`, `apply_quantization_config`, `decompress_model`)
  decompresses peagle's saved head to exactly peagle's dequantized weights (peer_fp8.py);
- speculators 0.9 loads the FP8 speculators export (transformers' compressed-tensors quantizer underneath) with
  every file tensor identical, and peagle reads speculators' re-save of it;
- vLLM 0.32 (CPU) serves the FP8 vLLM export of the shipped P-EAGLE head: greedy output identical to plain
  decoding, drafts accepted.

transformers 5.23's own load of a saved FP8 head runs in the normal suite (tests/test_fp8.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from interop_peers import run_peer, speculative
from safetensors.torch import save_file

import peagle
from peagle import fp8

HERE = Path(__file__).parent
SCHEMES = {"row": ("row", None), "block64": ("block", (64, 64))}
"""Granularities the peers read at the SmolLM2 sizes (576, 1536, 1728): a block must divide every layer."""
MAX_TOKENS = 8


def fp8_head(kind: str, granularity: str, block: tuple[int, int] | None) -> peagle.PEagleDrafter:
    from peagle.targets import default_drafter_path

    head = peagle.load_head(default_drafter_path(kind), dtype=torch.float32)
    return fp8.quantize_head(head, granularity, block or fp8.DEFAULT_BLOCK_SIZE)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_decompresses_saved_fp8_heads(scheme, tmp_path):
    head = fp8_head("peagle", *SCHEMES[scheme])
    head.save_pretrained(tmp_path / "head")
    reference = tmp_path / "dequantized.safetensors"
    save_file({n: m.dequantized_weight(torch.float32) for n, m in fp8.fp8_modules(head).items()}, reference)
    got = run_peer([str(HERE / "peer_fp8.py"), "decompress", str(tmp_path / "head"), str(reference)])
    assert got["format"] == "float-quantized"
    assert got["strategy"] == ("channel" if scheme == "row" else "block")
    assert got["quantized"] == sorted(fp8.fp8_modules(head))  # lm_head stays dense (`ignore`)
    assert got["missing"] == [] and got["unexpected"] == []
    assert got["mismatched"] == [] and got["dense_dtypes"] == ["torch.float32"]


def test_speculators_reads_fp8_speculators_exports(target, target_dir, tmp_path):
    head = fp8_head("peagle", "row", None)
    out = peagle.export(
        head, tmp_path / "export", layout="speculators", target_model=target[0], verifier=target_dir
    )
    resaved = tmp_path / "resaved"
    got = run_peer([str(HERE / "peer_speculators.py"), "load", str(out), str(resaved)])
    assert got["class"] == "PEagleDraftModel" and got["mismatched"] == []
    assert set(got["not_in_file"]) <= {
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }  # dense, from the target
    config = json.loads((resaved / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    back = peagle.load_head(resaved, target=target[0])  # speculators' own save of the FP8 head
    mods, orig = fp8.fp8_modules(back), fp8.fp8_modules(head)
    assert set(mods) == set(orig)
    assert all(torch.equal(mods[n].weight_scale, orig[n].weight_scale) for n in orig)


def test_vllm_serves_fp8_vllm_exports(target, target_dir, prompts, tmp_path):
    """vLLM's CPU build runs compressed-tensors W8A8 FP8 per channel (`ChannelWiseTorchFP8ScaledMMLinearKernel`).
    float32, one short prompt (FP8 matmuls on this CPU take seconds per step); lossless against transformers'
    own greedy decoding of the target."""
    from peagle.integrations.vllm.process import VLLM_RUNNER

    head = fp8_head("peagle", "row", None)
    out = peagle.export(head, tmp_path / "export", layout="vllm", target_model=target[0])
    ids = prompts[0]
    with torch.inference_mode():
        plain = (
            target[0].generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids.shape[1] :].tolist()
        )
    request = {
        "target": str(target_dir),
        "dtype": "float32",
        "prompts": [ids[0].tolist()],
        "max_tokens": MAX_TOKENS,
        "max_model_len": 512,
        "runs": [{"name": "fp8", "speculative_config": speculative(out, True)}],
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    (run,) = run_peer([str(VLLM_RUNNER), str(tmp_path / "request.json")])["runs"]
    assert run["outputs"] == [plain]  # lossless
    (counters,) = run["counters"]
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters
