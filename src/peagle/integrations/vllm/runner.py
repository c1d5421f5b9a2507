"""Run vLLM on fixed prompts, greedy, plain and with speculative heads; print outputs and counters as JSON.

A script for the interpreter of an environment that has vLLM (`PEAGLE_VLLM_PYTHON`; tests/interop/peer_env.sh
builds one): it imports nothing from peagle, and `peagle.evaluation.bench.run_vllm` runs it as a file.  Reads one JSON
request:

    {"target": folder, "dtype": "float32", "prompts": [[token ids], ...], "max_tokens": 64,
     "max_model_len": 2048, "repeats": 1,
     "runs": [{"name": "plain", "speculative_config": null}, {"name": "head", "speculative_config": {...}}]}

and prints one line `RESULT <json>`: per run `outputs` (generated ids per prompt), `seconds` (per prompt, the
median over `repeats`), `new_tokens` (per prompt), and the speculative counters of `llm.get_metrics()`
(`vllm:spec_decode_*`) of each prompt's first repeat, `counters`: `num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`, `accepted_per_pos`.  Requests run one at a time (concurrency 1, like `generate()`), after
one warm-up request.

With `--serve` it is instead a generation server for self-distillation (`peagle.data.vllm_engine`): the first
line of stdin sets up the engine, `{"target": folder, "dtype": "bfloat16", "max_model_len": 2048}`, and it
answers `READY`; every further line is a batch,

    {"prompts": [[token ids], ...], "max_tokens": 256, "temperature": 0.0, "top_p": 1.0,
     "seeds": [int per prompt] or null, "stop_token_ids": [ids]}

run with continuous batching and answered by one line `RESULT {"outputs": [[new ids], ...]}` (each ending at and
including its stop token when it stopped on one).  End of input shuts the engine down.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(metrics) -> dict:
    """The `vllm:spec_decode_*` counters of `LLM.get_metrics()` (zeros when no head is configured)."""
    out: dict = {k: 0 for k in COUNTERS}
    out["accepted_per_pos"] = []
    for m in metrics:
        name = m.name.removeprefix("vllm:spec_decode_")
        if name == m.name:
            continue
        if name in COUNTERS:
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            acc, values = out["accepted_per_pos"], [int(v) for v in m.values]
            n = max(len(acc), len(values))
            out["accepted_per_pos"] = [
                (acc[i] if i < len(acc) else 0) + (values[i] if i < len(values) else 0) for i in range(n)
            ]
    return out


def difference(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS}
    prev = before["accepted_per_pos"]
    out["accepted_per_pos"] = [
        v - (prev[i] if i < len(prev) else 0) for i, v in enumerate(after["accepted_per_pos"])
    ]
    return out


def make_llm(spec: dict, dtype: str, **extra):
    """vLLM's `LLM` for `spec` (`target`, optional `dtype` and `max_model_len`): eager, seeded, offline folder."""
    from vllm import LLM

    return LLM(
        model=spec["target"],
        dtype=spec.get("dtype", dtype),
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 2048)),
        seed=0,
        **extra,
    )


def run_one(req: dict, run: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(req, "float32", disable_log_stats=False, speculative_config=run.get("speculative_config"))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]))
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        outputs, times, counters = [], [], []
        for repeat in range(max(1, int(req.get("repeats", 1)))):
            per_prompt = []
            for i, p in enumerate(prompts):
                before = spec_counters(llm.get_metrics())
                t0 = time.perf_counter()
                (result,) = llm.generate([p], params, use_tqdm=False)
                per_prompt.append(time.perf_counter() - t0)
                if repeat == 0:
                    outputs.append(list(result.outputs[0].token_ids))
                    counters.append(difference(spec_counters(llm.get_metrics()), before))
                elif list(result.outputs[0].token_ids) != outputs[i]:
                    raise RuntimeError(
                        f"run {run['name']}: greedy output of prompt {i} changed between repeats"
                    )
            times.append(per_prompt)
        return {
            "name": run["name"],
            "outputs": outputs,
            "new_tokens": [len(o) for o in outputs],
            "seconds": [statistics.median(t[i] for t in times) for i in range(len(prompts))],
            "counters": counters,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def serve(stdin, stdout) -> None:
    """The `--serve` loop (see the module docstring): one engine, one batch per input line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    setup = json.loads(stdin.readline())
    llm = make_llm(setup, "bfloat16")
    print("READY", file=stdout, flush=True)
    try:
        for line in stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            stops = [int(t) for t in req.get("stop_token_ids") or []]
            seeds = req.get("seeds") or [None] * len(req["prompts"])
            params = [
                SamplingParams(
                    temperature=float(req.get("temperature", 0.0)),
                    top_p=float(req.get("top_p", 1.0)),
                    max_tokens=int(req["max_tokens"]),
                    seed=seed,
                    stop_token_ids=stops,
                )
                for seed in seeds
            ]
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
            results = llm.generate(prompts, params, use_tqdm=False)
            outputs = []
            for r in results:
                out = r.outputs[0]
                ids = list(out.token_ids)
                # a stop id that ended the sequence is reported as the stop reason, not always as a token
                if isinstance(out.stop_reason, int) and (not ids or ids[-1] != out.stop_reason):
                    ids.append(out.stop_reason)
                outputs.append(ids)
            print("RESULT " + json.dumps({"outputs": outputs}), file=stdout, flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(request_file: str) -> None:
    with open(request_file) as f:
        req = json.load(f)
    results = [run_one(req, run) for run in req["runs"]]
    print("RESULT " + json.dumps({"runs": results}), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from re-running this
    if sys.argv[1:] == ["--serve"]:
        serve(sys.stdin, sys.stdout)
    else:
        main(sys.argv[1])
