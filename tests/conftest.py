"""Shared tiny fixtures: a random Llama target (hidden 64, 8 layers, vocab 128) and a head for it."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from helpers import make_head, make_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# cost-model curves measured by tests go to a throw-away folder (the converted default target stays shared)
os.environ.setdefault("PEAGLE_COST_CACHE", tempfile.mkdtemp(prefix="peagle-cost-"))
torch.set_num_threads(
    1
)  # the suite runs beside other work on 2 cores; 1 thread avoids oversubscription stalls


@pytest.fixture
def tiny_target():
    return make_target()


@pytest.fixture
def tiny_head(tiny_target):
    return make_head(tiny_target)
