"""A reward that kills the process it runs in (a rollout worker) once, the first time it is called after the marker
file's step — a crashed worker mid-run. Real process death; only the trigger is staged."""

import os
from pathlib import Path

from rewards.jpeg import jpeg_kb


class KillOnce:
    def __init__(self, marker: str, after_calls: int = 3):
        self.marker, self.after_calls, self.calls = marker, after_calls, 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        m = Path(self.marker)
        if self.calls > self.after_calls and not m.exists():
            m.write_text(str(os.getpid()))
            os._exit(1)
        return [-jpeg_kb(im) for im in images]
