"""The seeds every stage pins: Python's hash seed, `random` and numpy's global generator.

Without torch: the data stages (download, stats, preprocess) compute with numpy alone, so they pin these
and never load torch, which costs seconds in each of their processes. The stages that compute with torch
pin these and torch's own seeds and switches (pinning.py's `pin_everything`).
"""

from __future__ import annotations

import os
import random

import numpy as np


def pin_seeds(seed: int) -> dict[str, str]:
    """Seed Python (`random`, and the hash seed of every subprocess) and numpy; what a run logs."""
    os.environ["PYTHONHASHSEED"] = str(seed)  # inherited by subprocesses (torchrun ranks)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    return {"PYTHONHASHSEED": str(seed)}
