"""Silence the libraries' own chatter (progress bars, dtype advice, deprecations) in every gerl process."""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as tl
    from diffusers.utils import logging as dl

    tl.set_verbosity_error()
    dl.set_verbosity_error()
    tl.disable_progress_bar()
    dl.disable_progress_bar()
