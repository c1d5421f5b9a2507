"""The interop suite: peagle against the real peers (vLLM CPU, speculators), in their own environment.

`make interop` builds that environment once (peer_env.sh) and runs this folder with `PEAGLE_VLLM_PYTHON` set to
its interpreter; without it every test here is skipped (the normal `make test` run).  Everything runs offline on
the embedded SmolLM2-135M-Instruct target and the shipped heads.

The expensive work happens once per session in the fixtures below: one vLLM process serves every configuration
(`VLLM_RUNS`), one `generate()` pass per head gives peagle's own counts on the same prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from interop_peers import MAX_NEW_TOKENS, PROMPTS, PYTHON_ENV, K, run_peer, speculative

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    here = [item for item in items if HERE in Path(str(item.fspath)).parents]
    skip = None
    python = os.environ.get(PYTHON_ENV)
    if here and python and not Path(python).is_file():
        raise pytest.UsageError(
            f"{PYTHON_ENV}={python} is not a file; expected the peers' Python interpreter."
        )
    if not python:
        skip = pytest.mark.skip(
            reason=f"interop suite: `make interop` runs it ({PYTHON_ENV} names the peers' env)"
        )
    for item in here:
        item.add_marker(pytest.mark.interop)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def target():
    from peagle.targets import load_default_target

    model, tokenizer = load_default_target(dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from peagle.targets import default_target_path

    return default_target_path().resolve()


@pytest.fixture(scope="session")
def prompts(target) -> list[torch.Tensor]:
    from peagle.data.evalsets import load_eval_prompts

    return load_eval_prompts(target[1], ["mtbench"], PROMPTS)["mtbench"]


@pytest.fixture(scope="session")
def exports(tmp_path_factory, target) -> dict[str, Path]:
    """The shipped heads exported by the CLI with `--target default`: `<kind>-<layout>` -> folder."""
    from peagle.cli import main
    from peagle.targets import default_drafter_path

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind in ("peagle", "eagle3"):
        for layout in ("vllm", "speculators"):
            folder = root / f"{kind}-{layout}"
            args = ["export", str(default_drafter_path(kind)), "--out", str(folder), "--layout", layout]
            assert main([*args, "--target", "default"]) == 0
            out[f"{kind}-{layout}"] = folder
    return out


@pytest.fixture(scope="session")
def aws_head(tmp_path_factory, exports) -> Path:
    """The shipped P-EAGLE head in the AWS heads' flat form, written here from the documented names (not by
    peagle): a flat Llama `config.json` (`model_type: "llama"`, `ptd_token_id`, `midlayer.*` tensors)."""
    from safetensors.torch import load_file, save_file

    src = exports["peagle-vllm"]
    raw = json.loads((src / "config.json").read_text())
    flat = {
        **raw["model"],
        **{k: v for k, v in raw.items() if k not in ("model", "model_type", "method", "peagle")},
    }
    flat["model_type"] = "llama"
    del flat["pard_token"]  # the AWS heads name the mask token ptd_token_id only
    folder = tmp_path_factory.mktemp("aws-head")
    (folder / "config.json").write_text(json.dumps(flat, indent=2))
    save_file(load_file(src / "model.safetensors"), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def vllm_runs(tmp_path_factory, exports, aws_head, target_dir, prompts) -> dict[str, dict]:
    """One vLLM process, float32, greedy, on the prompts: plain and with each head; name -> run result."""
    from peagle.integrations.vllm.process import VLLM_RUNNER

    runs = [
        {"name": "plain", "speculative_config": None},
        {"name": "peagle", "speculative_config": speculative(exports["peagle-vllm"], True)},
        {"name": "eagle3", "speculative_config": speculative(exports["eagle3-vllm"], False)},
        {"name": "aws", "speculative_config": speculative(aws_head, True)},
        {
            "name": "peagle-speculators",
            "speculative_config": speculative(exports["peagle-speculators"], True),
        },
    ]
    request = {
        "target": str(target_dir),
        "dtype": "float32",
        "prompts": [p[0].tolist() for p in prompts],
        "max_tokens": MAX_NEW_TOKENS,
        "max_model_len": 2048,
        "runs": runs,
    }
    req = tmp_path_factory.mktemp("vllm") / "request.json"
    req.write_text(json.dumps(request))
    result = run_peer([str(VLLM_RUNNER), str(req)], timeout=1200)
    return {r["name"]: r for r in result["runs"]}


@pytest.fixture(scope="session")
def peagle_runs(target, prompts) -> dict[str, dict]:
    """peagle's own `generate()` on the same prompts, float32, K drafts every round: kind -> outputs, stats."""
    from peagle import PEagleGenerationStats
    from peagle.targets import load_default_drafter

    model = target[0]
    out: dict[str, dict] = {"plain": {"outputs": []}}
    for ids in prompts:
        with torch.inference_mode():
            seq = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        out["plain"]["outputs"].append(seq[0, ids.shape[1] :].tolist())
    for kind in ("peagle", "eagle3"):
        head = load_default_drafter(model, kind=kind, dtype=torch.float32)
        outputs, stats = [], []
        for ids in prompts:
            with torch.inference_mode():
                seq = model.generate(
                    ids,
                    do_sample=False,
                    max_new_tokens=MAX_NEW_TOKENS,
                    assistant_model=head,
                    num_assistant_tokens=K,
                    num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0,
                )
            outputs.append(seq[0, ids.shape[1] :].tolist())
            stats.append(head.last_generation_stats)
        out[kind] = {"outputs": outputs, "stats": PEagleGenerationStats.merge(stats)}
    return out
