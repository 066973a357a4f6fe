"""Silence the libraries' own chatter (progress bars, dtype advice, deprecations) in every gerl process.

Through the variables transformers, diffusers and huggingface_hub read when they are imported (a user's own setting
wins), and at once for a library already imported: nothing is imported here, so a bad input found after this call
still fails in milliseconds. diffusers has no variable for its loading bars: gerl.models.loader calls
`quiet_imported()` once it has imported diffusers."""

from __future__ import annotations

import os
import sys
import warnings

QUIET_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
_requested = False


def quiet_libraries() -> None:
    global _requested
    _requested = True
    for var, value in QUIET_ENV.items():
        os.environ.setdefault(var, value)
    warnings.filterwarnings("ignore")
    quiet_imported()


def quiet_imported() -> None:
    """After quiet_libraries() (in this process): the same settings on transformers and diffusers, if imported."""
    if not _requested:
        return
    if "transformers" in sys.modules:
        from transformers.utils import logging as tl

        tl.set_verbosity_error()
        tl.disable_progress_bar()
    if "diffusers" in sys.modules:
        from diffusers.utils import logging as dl

        dl.set_verbosity_error()
        dl.disable_progress_bar()
