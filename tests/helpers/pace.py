"""A Lightning callback for runs of the real CLI in tests (``+callbacks.pace={_target_: tests.helpers.pace.Pace,
...}``): a fixed sleep before each training batch, so a test can act in the middle of a short run, and a stop at
the global step written in a file, which the test writes once it has seen what it waits for."""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import pytorch_lightning as pl


class Pace(pl.Callback):
    def __init__(self, seconds: float = 0.0, stop_file: Optional[str] = None) -> None:
        self.seconds, self.stop_file = float(seconds), stop_file

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.seconds:
            time.sleep(self.seconds)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.stop_file and os.path.exists(self.stop_file):
            text = open(self.stop_file).read().strip()
            if text and trainer.global_step >= int(text):
                trainer.should_stop = True
