"""Batches and features: the data collator (the feature cache is tested with the trainer)."""

from __future__ import annotations

import pytest
import torch

from peagle.training import PEagleDataCollator


def test_collator_pads_right_and_truncates():
    feats = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "target_hidden_states": torch.ones(3, 4)},
        {
            "input_ids": [8, 9, 10, 11, 12],
            "loss_mask": [0, 0, 1, 1, 1],
            "target_hidden_states": torch.ones(5, 4),
        },
    ]
    batch = PEagleDataCollator(pad_token_id=0, max_length=4)(feats)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]
    assert (
        batch["target_hidden_states"].shape == (2, 4, 4)
        and batch["target_hidden_states"][0, 3].abs().sum() == 0
    )
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        PEagleDataCollator()([{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    with pytest.raises(KeyError, match="loss_mask"):
        PEagleDataCollator()([{"input_ids": [1, 2, 3]}])


def test_collator_says_how_much_max_length_cuts(caplog):
    """An example longer than max_length is never cut silently: the warning names the count and the tokens lost."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    feats = [
        {"input_ids": list(range(3, 13)), "loss_mask": [1] * 10},
        {"input_ids": [5, 6], "loss_mask": [0, 1]},
    ]
    with caplog.at_level(logging.WARNING, logger="peagle.data.features"):
        PEagleDataCollator(max_length=10)(feats)
    assert not caplog.records  # nothing cut, nothing said
    with caplog.at_level(logging.WARNING, logger="peagle.data.features"):
        PEagleDataCollator(max_length=4)(feats)
    text = caplog.text
    assert "1 of 2 examples" in text and "max_length=4" in text and "6 of their 10 tokens" in text
