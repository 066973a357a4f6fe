"""Where outputs go: check that a directory can really be written before any work starts.

`os.access` is not enough: it says yes to root under /proc, and knows nothing of immutable or read-only mounts.
So the check makes (and removes) an empty temporary directory where the output will go.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gerl.errors import UserError


def unwritable_reason(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (or in its nearest existing ancestor, where it would be made),
    or None. Leaves nothing behind."""
    probe = Path(os.path.abspath(directory))
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gerl-probe-", dir=probe))
    except OSError as e:
        return f"cannot create files in {probe} ({e.strerror or e})"
    return None


def check_writable(directory: Path, what: str) -> None:
    """UserError naming `what` (e.g. "--out /x" or "output_dir /x") when `directory` cannot be written."""
    reason = unwritable_reason(directory)
    if reason is not None:
        raise UserError(f"{what} is not writable: {reason}; choose another location")
