"""Batches and target features: the data collator, one frozen target forward, and the on-disk feature cache.

[`PEagleDataCollator`] pads examples (`input_ids`, `loss_mask`) into right-padded batches; [`capture_features`]
runs the frozen target once and returns the drafter's inputs (aux features) and the target's last hidden state
(for the loss); [`FeatureCache`] stores those features as safetensors shards when the same examples are trained on
for many epochs.  Feature caches are large (~4.6 KB per token for SmolLM2) and stay out of git; the token-id
data itself lives in [`peagle.data.shards`].
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from .shards import load_examples, save_examples

logger = logging.get_logger(__name__)


def _warn_truncation(lengths: list[int], max_length: int) -> None:
    """Say how much of a batch `max_length` cuts: a user who meant to train on long examples must know."""
    long = [n for n in lengths if n > max_length]
    if long:
        logger.warning(
            f"{len(long)} of {len(lengths)} examples in this batch are longer than max_length={max_length} and are "
            f"cut to it: {sum(long) - max_length * len(long)} of their {sum(long)} tokens are not trained on "
            f"(longest {max(long)}). Raise `max_length` (and set `partition_memory_budget` for memory) to train on them."
        )


@dataclass
class PEagleDataCollator:
    """Pad examples into a batch (right padding).

    Args:
        pad_token_id: id written into padding (masked out by `attention_mask` anyway).
        max_length: truncate longer examples to their first `max_length` tokens, with a warning that says how
            many tokens each batch loses.

    Each feature needs `input_ids` and `loss_mask` (same length); cached features may add `target_hidden_states`
    `(T, 3 * H_t)` and `target_last_hidden` `(T, H_t)`.  Returns `input_ids`, `attention_mask`, `loss_mask` as
    `(B, T)` int64 and the cached features padded with zeros to `(B, T, ...)`.
    """

    pad_token_id: int = 0
    max_length: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("PEagleDataCollator got an empty list of examples.")
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long).flatten() for f in features]
        masks = []
        for i, f in enumerate(features):
            if "loss_mask" not in f:
                raise KeyError(f"example {i} has keys {sorted(f)}; expected 'input_ids' and 'loss_mask'.")
            m = torch.as_tensor(f["loss_mask"], dtype=torch.long).flatten()
            if m.numel() != ids[i].numel():
                raise ValueError(
                    f"example {i}: loss_mask has {m.numel()} entries, input_ids {ids[i].numel()}."
                )
            masks.append(m)
        if self.max_length is not None:
            _warn_truncation([x.numel() for x in ids], self.max_length)
            ids = [x[: self.max_length] for x in ids]
            masks = [m[: self.max_length] for m in masks]
        length = max(x.numel() for x in ids)
        bsz = len(ids)
        batch = {
            "input_ids": torch.full((bsz, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(bsz, length, dtype=torch.long),
            "loss_mask": torch.zeros(bsz, length, dtype=torch.long),
        }
        for b, (x, m) in enumerate(zip(ids, masks)):
            batch["input_ids"][b, : x.numel()] = x
            batch["attention_mask"][b, : x.numel()] = 1
            batch["loss_mask"][b, : m.numel()] = m
        for key in ("target_hidden_states", "target_last_hidden"):
            if key in features[0]:
                tensors = [torch.as_tensor(f[key])[: ids[b].numel()] for b, f in enumerate(features)]
                out = tensors[0].new_zeros(bsz, length, tensors[0].shape[-1])
                for b, t in enumerate(tensors):
                    out[b, : t.shape[0]] = t
                batch[key] = out
        return batch


def capture_features(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, aux_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward: `(aux, last)` features.

    Returns:
        `aux` `(B, T, 3 * H_t)`: ``output_hidden_states[i]`` for i in `aux_layer_ids`, concatenated in that order
        (index 0 = embeddings, i = input of decoder layer i); `last` `(B, T, H_t)`: the target's final normed
        hidden state, from which the target's logits are ``lm_head(last)``.
    """
    base = (
        target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, target.base_model_prefix)
    )
    ids = [int(i) for i in aux_layer_ids]
    with torch.no_grad():
        out = base(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=ids, use_cache=False
        )
        hidden = out.hidden_states
        if hidden is None or any(hidden[i] is None for i in ids):  # versions without per-index selection
            out = base(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
            hidden = out.hidden_states
        aux = torch.cat([hidden[i] for i in ids], dim=-1)
    return aux, out.last_hidden_state


class FeatureCache(torch.utils.data.Dataset):
    """Target features of a fixed set of examples, stored once as safetensors shards and reused across runs.

    Each item is the example plus `target_hidden_states` `(T, 3 * H_t)` and `target_last_hidden` `(T, H_t)`
    in `dtype`; `PEagleTrainer` then skips the target forward (it still uses the target's `lm_head` rows of the
    draft vocabulary for the loss).  About ``4 * H_t * 2`` bytes per token in fp16 (4.6 KB for H_t = 576).

    Build with [`FeatureCache.build`]; an existing directory whose fingerprint (target config, aux layers, dtype,
    examples) matches is reused instead of recomputed.
    """

    INDEX = "feature_cache.json"

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        with open(os.path.join(self.directory, self.INDEX), encoding="utf-8") as fh:
            self.index = json.load(fh)
        self.examples = load_examples(os.path.join(self.directory, "examples.jsonl"))
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from safetensors import safe_open

        shard = self.index["locations"][i]
        if shard not in self._handles:
            self._handles[shard] = safe_open(os.path.join(self.directory, shard), framework="pt")
        handle = self._handles[shard]
        item = dict(self.examples[i])
        item["target_hidden_states"] = handle.get_tensor(f"aux.{i}")
        item["target_last_hidden"] = handle.get_tensor(f"last.{i}")
        return item

    @property
    def size_bytes(self) -> int:
        """Bytes on disk of the feature shards."""
        return sum(
            os.path.getsize(os.path.join(self.directory, s)) for s in sorted(set(self.index["locations"]))
        )

    def __repr__(self) -> str:
        return (
            f"FeatureCache({self.directory!r}, examples={len(self)}, tokens={self.index['num_tokens']}, "
            f"size={self.size_bytes / 2**20:.1f} MiB)"
        )

    @staticmethod
    def fingerprint(target, examples: Sequence[dict[str, Any]], aux_layer_ids: Sequence[int], dtype) -> str:
        """sha256 of what the features depend on: the target config, the aux layers, the dtype, the tokens."""
        h = hashlib.sha256()
        cfg = (
            target.config.to_json_string()
            if hasattr(target.config, "to_json_string")
            else repr(target.config)
        )
        h.update(cfg.encode())
        h.update(repr(([int(i) for i in aux_layer_ids], str(dtype))).encode())
        for ex in examples:
            h.update(torch.as_tensor(ex["input_ids"], dtype=torch.int64).numpy().tobytes())
            h.update(b"|")
        return h.hexdigest()

    @classmethod
    def build(
        cls,
        target,
        examples: Sequence[dict[str, Any]],
        directory: str | os.PathLike,
        aux_layer_ids: Sequence[int],
        *,
        batch_size: int = 8,
        dtype: torch.dtype | None = None,
        shard_size: int = 512 * 2**20,
        progress: bool = True,
    ) -> FeatureCache:
        """Run the target once over `examples` and store the features under `directory` (or reuse them).

        Args:
            target: the frozen target causal LM.
            examples: dicts with `input_ids` and `loss_mask`.
            aux_layer_ids: the head's `eagle_aux_hidden_state_layer_ids`.
            dtype: storage dtype of the features.  None (the default): float16 when the target's features fit its
                range (|x| <= 65,504), else bfloat16 (Gemma 3's reach beyond it): the build switches, and says so,
                at the first example that does not fit.  An explicit float16 that cannot hold them raises
                `ValueError` naming the cache.
            shard_size: bytes per safetensors shard (approximate).
        """
        directory = os.fspath(directory)
        candidates = [dtype] if dtype is not None else [torch.float16, torch.bfloat16]
        index_path = os.path.join(directory, cls.INDEX)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as fh:
                index = json.load(fh)
            for candidate in candidates:
                if index.get("fingerprint") == cls.fingerprint(target, examples, aux_layer_ids, candidate):
                    cache = cls(directory)
                    if cache._holds_finite_features():
                        return cache
                    logger.warning(
                        "feature cache %s holds non-finite features (built in %s, which cannot hold this target's "
                        "activations); building it again",
                        directory,
                        index.get("dtype"),
                    )
                    break
        for candidate in candidates:
            try:
                return cls._build(
                    target, examples, directory, aux_layer_ids, candidate, batch_size, shard_size, progress
                )
            except _FeaturesOverflow as overflow:
                if dtype is not None:
                    raise ValueError(
                        f"feature cache {directory}: the target's features reach {overflow.peak:,.0f} (example "
                        f"{overflow.example}), beyond {str(candidate).removeprefix('torch.')}'s range "
                        f"({torch.finfo(candidate).max:,.0f}); build it in bfloat16 or float32 (dtype=), or "
                        "leave dtype to peagle."
                    ) from None
                logger.warning(
                    "feature cache %s: the target's features reach %s (example %d), beyond float16's range; "
                    "storing them in bfloat16",
                    directory,
                    f"{overflow.peak:,.0f}",
                    overflow.example,
                )
        raise AssertionError("unreachable: bfloat16 holds every finite float32")

    def _holds_finite_features(self) -> bool:
        """Whether every stored feature is finite: recorded (`max_abs`) by this version's builds; an older cache is
        read once and the record added to its index."""
        if "max_abs" not in self.index:
            peak = 0.0
            for i in range(len(self)):
                item = self[i]
                for key in ("target_hidden_states", "target_last_hidden"):
                    values = item[key].float().abs()
                    if not bool(torch.isfinite(values).all()):
                        peak = math.inf
                    elif values.numel():
                        peak = max(peak, float(values.max()))
            self.index["max_abs"] = peak
            with open(os.path.join(self.directory, self.INDEX), "w", encoding="utf-8") as fh:
                json.dump(self.index, fh)
        return math.isfinite(self.index["max_abs"])

    @classmethod
    def _build(cls, target, examples, directory, aux_layer_ids, dtype, batch_size, shard_size, progress):
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        fp = cls.fingerprint(target, examples, aux_layer_ids, dtype)
        index_path = os.path.join(directory, cls.INDEX)
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(index_path):
            os.remove(index_path)  # an index names a complete cache only
        for name in os.listdir(directory):
            if name.startswith("features-") and name.endswith(".safetensors"):
                os.remove(os.path.join(directory, name))
        save_examples(examples, os.path.join(directory, "examples.jsonl"))
        device = next(target.parameters()).device
        locations: list[str] = [""] * len(examples)
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shard_id, num_tokens, peak = 0, 0, 0, 0.0
        limit = torch.finfo(dtype).max

        def flush():
            nonlocal shard, shard_bytes, shard_id
            if shard:
                save_file(shard, os.path.join(directory, f"features-{shard_id:05d}.safetensors"))
                shard, shard_bytes, shard_id = {}, 0, shard_id + 1

        collate = PEagleDataCollator()
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
        bar = tqdm(total=len(examples), desc="caching features", unit="example", disable=not progress)
        try:
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                batch = collate([examples[i] for i in chunk])
                aux, last = capture_features(
                    target, batch["input_ids"].to(device), batch["attention_mask"].to(device), aux_layer_ids
                )
                for r, i in enumerate(chunk):
                    t = int(batch["attention_mask"][r].sum())
                    top = max(float(aux[r, :t].abs().max()), float(last[r, :t].abs().max())) if t else 0.0
                    if not math.isfinite(top):
                        raise ValueError(
                            f"the target's own features are non-finite on example {i} (target dtype "
                            f"{str(next(target.parameters()).dtype).removeprefix('torch.')}): load the target in "
                            "bfloat16 or float32."
                        )
                    if top > limit:
                        raise _FeaturesOverflow(top, i)
                    peak = max(peak, top)
                    shard[f"aux.{i}"] = aux[r, :t].to("cpu", dtype).contiguous()
                    shard[f"last.{i}"] = last[r, :t].to("cpu", dtype).contiguous()
                    shard_bytes += (aux.shape[-1] + last.shape[-1]) * t * shard[f"aux.{i}"].element_size()
                    locations[i] = f"features-{shard_id:05d}.safetensors"
                    num_tokens += t
                if shard_bytes >= shard_size:
                    flush()
                bar.update(len(chunk))
            flush()
        finally:
            bar.close()
        with open(index_path, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "fingerprint": fp,
                    "locations": locations,
                    "num_tokens": num_tokens,
                    "dtype": str(dtype),
                    "max_abs": peak,
                },
                fh,
            )
        return cls(directory)


class _FeaturesOverflow(Exception):
    """A feature beyond the storage dtype's range (`peak`, on example `example`)."""

    def __init__(self, peak: float, example: int):
        super().__init__(peak, example)
        self.peak, self.example = peak, example


__all__ = ["PEagleDataCollator", "capture_features", "FeatureCache"]
