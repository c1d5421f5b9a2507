"""Shared tiny fixtures: a random Llama target (hidden 64, 8 layers, vocab 128) and a head for it."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import peagle

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# cost-model curves measured by tests go to a throw-away folder (the converted default target stays shared)
os.environ.setdefault("PEAGLE_COST_CACHE", tempfile.mkdtemp(prefix="peagle-cost-"))
torch.set_num_threads(
    1
)  # the suite runs beside other work on 2 cores; 1 thread avoids oversubscription stalls


def tiny_target_config(**overrides) -> LlamaConfig:
    values = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_target(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_target_config(**overrides))
    return model.eval()


def make_head(target, seed: int = 1, **overrides) -> peagle.PEagleDrafter:
    torch.manual_seed(seed)
    # tiny heads draft K every round unless a test asks for the cost rule (confidence_threshold=None)
    values = dict(num_hidden_layers=2, mask_token_id=127, confidence_threshold=0.0)
    values.update(overrides)
    cfg = peagle.PEagleConfig.for_target(target.config, **values)
    return peagle.PEagleDrafter(cfg).eval()


@pytest.fixture
def tiny_target():
    return make_target()


@pytest.fixture
def tiny_head(tiny_target):
    return make_head(tiny_target)
