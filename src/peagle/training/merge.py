"""Weight averaging of heads: arms trained side by side from one starting head (a "model soup"), or successive
stages of one chain (a trajectory average).

Two processes that continue the same head on different data, one CPU core each, spend twice the budget of one
process; averaging their weights puts both halves into one head.  Averaging the last few stages of a chain
instead costs nothing: the result's budget is the newest stage's, and it often sits a little higher on the
held-out curve than any of them.  Heads must share every tensor's name and shape and their integer buffers (the
draft vocabulary's `d2t` / `t2d`): they must come from one starting head.  The average is taken in float32 and
stored in each tensor's own dtype.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from .recipe import training_budget

SUMMARY = "train_summary.json"


def average_state_dicts(
    state_dicts: Sequence[dict[str, Any]], weights: Sequence[float] | None = None
) -> dict:
    """The weighted mean of several state dicts of one architecture (uniform without `weights`).

    Floating-point tensors are averaged in float32 and cast back to their dtype; every other tensor (index
    buffers) must be equal in all of them.  Raises ValueError on differing names, shapes or buffers."""
    import torch

    if not state_dicts:
        raise ValueError("nothing to average")
    weights = [1.0] * len(state_dicts) if weights is None else [float(w) for w in weights]
    if len(weights) != len(state_dicts) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"weights {weights}: one non-negative weight per head, not all zero")
    total = sum(weights)
    first = state_dicts[0]
    for i, other in enumerate(state_dicts[1:], 1):
        if set(other) != set(first):
            differ = sorted(set(other) ^ set(first))
            raise ValueError(f"head {i} has other tensors than head 0: {', '.join(differ[:5])}")
    out = {}
    for name, tensor in first.items():
        tensors = [sd[name] for sd in state_dicts]
        if any(t.shape != tensor.shape for t in tensors):
            raise ValueError(f"{name}: shapes differ ({', '.join(str(tuple(t.shape)) for t in tensors)})")
        if not tensor.is_floating_point():
            if any(not torch.equal(t, tensor) for t in tensors):
                raise ValueError(f"{name} differs between the heads: they do not come from one starting head")
            out[name] = tensor.clone()
            continue
        mean = sum(w / total * t.float() for w, t in zip(weights, tensors))
        out[name] = mean.to(tensor.dtype).contiguous()
    return out


def _own(summary: dict[str, Any]) -> dict[str, Any]:
    """A stage's own record: its summary without the stages before it."""
    return {k: v for k, v in summary.items() if k not in ("previous_stage", "cumulative")}


def _ancestors(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The stages before `summary`, newest first, along `previous_stage`."""
    chain, stage = [], summary.get("previous_stage")
    while stage:
        chain.append(stage)
        stage = stage.get("previous_stage")
    return chain


def merged_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A train_summary.json for the average of heads trained side by side: its own stage counts every arm's
    token-passes, optimizer steps and CPU-seconds (so budgets add up along `previous_stage`), keeps each arm's
    record under `arms`, and continues the arms' newest common earlier stage (no `previous_stage` when they share
    none).

    An arm that reached the common stage through stages of its own (say, it continued another arm's head) counts
    those too, recorded under its `after_common_stage`, except a stage that is an earlier finalisation of another
    arm's own run (same `output_dir`, no more optimizer steps): a run resumed from its checkpoints counts the steps
    before the resume again."""
    chains = [_ancestors(s) for s in summaries]
    common = next((stage for stage in chains[0] if all(stage in chain for chain in chains[1:])), None)
    runs = {
        (s.get("output_dir"), int(s.get("optimizer_steps") or 0)) for s in summaries if s.get("output_dir")
    }
    own = []
    for summary, chain in zip(summaries, chains):
        record = _own(summary)
        # an arm's own stages since the common one (without a common stage, each arm counts only itself)
        between = chain[: chain.index(common)] if common is not None else []
        counted = [
            _own(stage)
            for stage in between
            if not any(
                stage.get("output_dir") == out and int(stage.get("optimizer_steps") or 0) <= steps
                for out, steps in runs
            )
        ]
        if counted:
            record["after_common_stage"] = counted
        own.append(record)
    stages = [s for r in own for s in (r, *r.get("after_common_stage", []))]
    cpu_seconds = sum(float(s.get("seconds") or 0.0) * int(s.get("threads") or 1) for s in stages)
    merged = {
        "merge": "weight average",
        "arms": own,
        "response_tokens_trained": sum(int(s.get("response_tokens_trained") or 0) for s in stages),
        "response_tokens_trained_estimated": any(s.get("response_tokens_trained_estimated") for s in stages),
        "optimizer_steps": sum(int(s.get("optimizer_steps") or 0) for s in stages),
        "seconds": round(cpu_seconds, 1),
        "threads": 1,  # seconds above are CPU-seconds of all arms
        "wall_seconds": max(float(s.get("seconds") or 0.0) for s in summaries),
    }
    if common is not None:
        merged["previous_stage"] = common
    return merged


def chain_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A train_summary.json for the average of successive stages of one chain, given oldest first: the newest
    stage's summary (its `previous_stage` chain, hence its budget: averaging trains nothing), with a
    `chain_average` record of the members.  Raises ValueError unless every earlier summary is an ancestor of the
    next one along `previous_stage`."""
    if len(summaries) < 2:
        raise ValueError("a chain average needs at least two stages")
    for i, (older, newer) in enumerate(zip(summaries, summaries[1:])):
        if older not in _ancestors(newer):
            raise ValueError(
                f"head {i} is not an earlier stage of head {i + 1}: a chain average takes stages of one chain, "
                "oldest first"
            )
    newest = dict(summaries[-1])
    newest["chain_average"] = {
        "stages": len(summaries),
        "token_passes": [training_budget(s)["response_tokens_trained"] for s in summaries],
    }
    return newest


def average_heads(
    heads: Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    weights: Sequence[float] | None = None,
    chain: bool = False,
) -> Path:
    """Average the weights of peagle-layout head folders into `output_dir`.

    The config and remote code are the first head's (with `chain=True` the newest stage's, the last),
    without its `draft_calibration` (fitted to other weights) and without a model card (it would describe
    another head).  Heads trained side by side (the default): when every head has a train_summary.json, the
    output gets [`merged_summary`]'s, with the cumulative budget.  `chain=True`: the heads are successive
    stages of one chain, oldest first, each with a train_summary.json; the output gets [`chain_summary`]'s,
    whose budget is the newest stage's.  Calibrate the result (`peagle calibrate`) before cost-aware drafting
    uses it.  Returns the output folder."""
    from safetensors.torch import load_file, save_file

    folders = [Path(h) for h in heads]
    if len(folders) < 2:
        raise ValueError("average_heads needs at least two heads")
    for folder in folders:
        if not (folder / SAFE_WEIGHTS_NAME).is_file():
            raise FileNotFoundError(
                f"{folder}: no {SAFE_WEIGHTS_NAME} (a peagle-layout head folder is expected)"
            )
    summaries = None
    if all((f / SUMMARY).is_file() for f in folders):
        summaries = [json.loads((f / SUMMARY).read_text()) for f in folders]
    if chain:
        if summaries is None:
            raise FileNotFoundError(f"a chain average reads every stage's {SUMMARY} (to check the chain)")
        summary = chain_summary(summaries)  # checked before any weight is read
        summary["chain_average"]["from"] = [str(f) for f in folders]
    configs = [json.loads((f / CONFIG_NAME).read_text()) for f in folders]
    shape_keys = (
        "hidden_size",
        "num_hidden_layers",
        "draft_vocab_size",
        "vocab_size",
        "num_parallel_positions",
    )
    for folder, config in zip(folders[1:], configs[1:]):
        differ = [k for k in shape_keys if config.get(k) != configs[0].get(k)]
        if differ:
            raise ValueError(f"{folder} differs from {folders[0]} in {', '.join(differ)}")
    state = average_state_dicts([load_file(f / SAFE_WEIGHTS_NAME) for f in folders], weights)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    source = -1 if chain else 0  # the head whose config and remote code the average takes
    config = dict(configs[source])
    # a calibration was fitted to that head's weights, not to the average's
    if config.get("draft_calibration") is not None:
        config["draft_calibration"] = None
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for code in folders[source].glob("*.py"):  # the remote code that config.json's auto_map names
        shutil.copyfile(code, out / code.name)
    if chain:
        if weights is not None:
            summary["chain_average"]["weights"] = [float(w) for w in weights]
    elif summaries is not None:
        summary = merged_summary(summaries)
        summary["merged_from"] = [str(f) for f in folders]
        if weights is not None:
            summary["merge_weights"] = [float(w) for w in weights]
    if summaries is not None:
        summary["cumulative"] = training_budget(summary)
        (out / SUMMARY).write_text(json.dumps(summary, indent=2, default=str))
    return out


__all__ = ["average_heads", "average_state_dicts", "chain_summary", "merged_summary"]
