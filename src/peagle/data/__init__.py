"""The data heads are trained and evaluated on: what generation, training and evaluation all read.

One module per kind of data:

- `prompts`: chat formatting, prompt files and offline prompt sets (standard-library code, stubs), the guard that
  keeps MT-Bench and HumanEval out of training data;
- `evalsets`: the evaluation sets themselves (MT-Bench, HumanEval) and `is_evaluation_prompt`;
- `distill`: self-distillation ([`self_distill`]) and Magpie prompts ([`synthesize_prompts`]); `vllm_engine`: its
  vLLM back end;
- `documents`: long teacher-forced examples from a folder of documents;
- `shards`: examples on disk (JSON lines, token-id shards with a manifest); `packing` (`peagle pack`) and `growth`
  (`peagle grow-data`, resumable cycles) build them;
- `vocab`: the draft vocabulary (its ids and size);
- `features`: the data collator, one frozen target forward (`capture_features`) and the [`FeatureCache`].

This package imports nothing from `peagle.generation`, `peagle.training` or `peagle.evaluation` (a test checks the
package graph), so each of them can read data without reading the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "prompts": [
        "chat_prompt_ids",
        "user_turn_template",
        "check_not_evaluation",
        "drop_evaluation_prompts",
        "load_prompts",
        "stdlib_code_prompts",
        "stdlib_stub_prompts",
        "default_prompt_set",
    ],
    "evalsets": ["EVAL_SETS", "load_eval_prompts", "is_evaluation_prompt"],
    "distill": ["generate_responses", "self_distill", "synthesize_prompts"],
    "vllm_engine": ["VLLMEngine"],
    "documents": ["read_documents", "document_examples", "default_document_lengths", "document_questions"],
    "features": ["PEagleDataCollator", "FeatureCache", "capture_features"],
    "vocab": ["select_draft_vocab", "draft_vocab_coverage", "choose_draft_vocab_size"],
    "shards": ["save_examples", "load_examples", "write_shard", "read_shards"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # static names for type checkers and IDEs; the runtime imports are lazy
    from .distill import generate_responses, self_distill, synthesize_prompts  # noqa: F401
    from .documents import (  # noqa: F401
        default_document_lengths,
        document_examples,
        document_questions,
        read_documents,
    )
    from .evalsets import EVAL_SETS, is_evaluation_prompt, load_eval_prompts  # noqa: F401
    from .features import FeatureCache, PEagleDataCollator, capture_features  # noqa: F401
    from .prompts import (  # noqa: F401
        chat_prompt_ids,
        check_not_evaluation,
        default_prompt_set,
        drop_evaluation_prompts,
        load_prompts,
        stdlib_code_prompts,
        stdlib_stub_prompts,
        user_turn_template,
    )
    from .shards import load_examples, read_shards, save_examples, write_shard  # noqa: F401
    from .vllm_engine import VLLMEngine  # noqa: F401
    from .vocab import choose_draft_vocab_size, draft_vocab_coverage, select_draft_vocab  # noqa: F401


def __getattr__(name: str):
    """Import the submodule of a public name on first use (keeps `import peagle` light)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [name for names in _EXPORTS.values() for name in names]
