"""`make gpu-check`: the project's checks for a CUDA GPU, in one command, with no downloads.

1. Lossless: the embedded SmolLM2 target with both shipped heads, greedy, in float32 and bfloat16, at batch 1 and
   batch 8 (left-padded MT-Bench and HumanEval prompts): every row equal to plain (batched) greedy in the same
   dtype.
2. The verify-cost curve of a randomly initialised Llama of about 1B parameters in bfloat16 at B = 1 and 8:
   seconds to verify n = 1..8 tokens per row (on a GPU the curve is nearly flat: the cost rule then drafts K).
3. The batch table: `peagle bench --batch_sizes 1,2,4,8` on the embedded target (16 prompts, 128 new tokens).
4. The FP8 kernel tests (`pytest -m gpu tests/test_fp8.py`).

Writes `gpu_check.json` (and the batch table's JSON and PNG) under `--out`.  On a machine without a CUDA GPU
it says so and exits 0 having measured nothing.  Budget: about 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _rows(tokenizer, count: int):
    from peagle.data.evalsets import EVAL_SETS, chat_prompt_tensor

    texts = [t for pair in zip(EVAL_SETS["mtbench"](count), EVAL_SETS["humaneval"](count)) for t in pair]
    return [chat_prompt_tensor(tokenizer, t) for t in texts[:count]]


def lossless(target, tokenizer, heads: dict, device) -> list[dict]:
    import torch

    from peagle.evaluation.bench_batch import left_pad

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = target.to(dtype)
        for kind, head in heads.items():
            head.attach_target(model)
            for batch in (1, 8):
                ids, mask = left_pad(_rows(tokenizer, batch), tokenizer.pad_token_id)
                ids, mask = ids.to(device), mask.to(device)
                kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=64)
                plain = model.generate(ids, **kw)
                drafted = model.generate(ids, assistant_model=head, assistant_confidence_threshold=0.0, **kw)
                stats = head.last_generation_stats
                results.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "head": kind,
                        "batch_size": batch,
                        "identical": bool(torch.equal(plain, drafted)),
                        "tokens_per_target_pass": stats.tokens_per_target_pass,
                    }
                )
                print(json.dumps(results[-1]))
    target.to(torch.float32)
    return results


def cost_curve(device) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle.generation.cost import measure_cost_model

    cfg = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    out = []
    for batch in (1, 8):
        curve = measure_cost_model(model, max_tokens=8, batch_size=batch).verify_seconds
        out.append(
            {"parameters": params, "batch_size": batch, "verify_ms": [round(s * 1e3, 3) for s in curve]}
        )
        print(json.dumps(out[-1]))
    del model
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_results", help="folder for gpu_check.json and the batch table")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine; skipped (nothing was measured).")
        return 0
    import peagle

    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.perf_counter()
    target, tokenizer = peagle.load_default_target()
    target = target.to(device)
    heads = {kind: peagle.load_default_drafter(target, kind=kind).to(device) for kind in ("peagle", "eagle3")}
    report["lossless"] = lossless(target, tokenizer, heads, device)
    report["cost_curve_1b"] = cost_curve(device)
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "peagle.cli",
            "bench",
            "--batch_sizes",
            "1,2,4,8",
            "--limit",
            "8",
            "--max_new_tokens",
            "128",
            "--out",
            str(out),
        ],  # fmt: skip
        check=False,
    )
    report["batch_table"] = (
        str(out / "bench_batch.json") if bench.returncode == 0 else f"failed ({bench.returncode})"
    )
    fp8 = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_fp8.py"], check=False
    )
    report["fp8_tests"] = "passed" if fp8.returncode == 0 else f"failed ({fp8.returncode})"
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    ok = all(r["identical"] for r in report["lossless"]) and fp8.returncode == 0 and bench.returncode == 0
    print(
        f"gpu-check: {'passed' if ok else 'FAILED'} in {report['seconds']} s; wrote {out / 'gpu_check.json'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
