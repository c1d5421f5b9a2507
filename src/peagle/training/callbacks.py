"""Trainer callbacks of `PEagleTrainer`: [`TrainingCountsCallback`] keeps the run's token-pass count and training
time in every checkpoint (`COUNTS_FILE`), so a resumed run counts from where it stopped."""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

COUNTS_FILE = "peagle_budget_{}.json"
"""Per-process record of the response tokens trained and the training seconds spent, written into every checkpoint
(read back on resume)."""


class TrainingCountsCallback(TrainerCallback):
    """Writes the trainer's token-pass count and training time into each checkpoint, so a resumed run counts both from
    where it stopped."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            path = os.path.join(folder, COUNTS_FILE.format(self.trainer.accelerator.process_index))
            with open(path, "w", encoding="utf-8") as fh:
                record = {
                    "response_tokens_trained": self.trainer._response_tokens,
                    "training_seconds": round(self.trainer.training_seconds(), 1),
                }
                json.dump(record, fh)
        return control


__all__ = ["COUNTS_FILE", "TrainingCountsCallback"]
