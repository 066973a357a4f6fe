"""Stage timeline: wall-clock spans per worker lane, appended to RUN_DIR/timeline.jsonl.

A span is {"lane", "name", "step", "start", "end", "depth"} with Unix-epoch seconds. Within one lane, spans of the
same depth never overlap; a span of depth d+1 lies inside a span of depth d of the same lane (e.g. the trainer's
"step" span holds its "wait_reward", "train", "sync" spans). Lanes are one per worker: "trainer", "rollout",
"reward/<name>/<worker>", and, with the Ray engine, one per actor.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self, path: Path | None):
        self.path = Path(path) if path is not None else None
        self._spans: list[dict] = []
        self._lock = threading.Lock()
        self._depth: dict[str, int] = {}

    def add(self, lane: str, name: str, start: float, end: float, step: int, depth: int = 0, **extra) -> None:
        with self._lock:
            self._spans.append({"lane": lane, "name": name, "step": step, "start": start, "end": end, "depth": depth,
                                **extra})

    @contextmanager
    def span(self, lane: str, name: str, step: int):
        """Time a block on `lane`; nested spans on the same lane get depth + 1."""
        depth = self._depth.get(lane, 0)
        self._depth[lane] = depth + 1
        start = time.time()
        try:
            yield
        finally:
            self._depth[lane] = depth
            self.add(lane, name, start, time.time(), step, depth)

    def flush(self) -> None:
        """Append the buffered spans to the file (once per step keeps the I/O negligible)."""
        with self._lock:
            spans, self._spans = self._spans, []
        if self.path is not None and spans:
            with self.path.open("a") as f:
                for s in spans:
                    f.write(json.dumps(s) + "\n")


def read_timeline(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "timeline.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def truncate_timeline(run_dir: Path, resume_step: int | None) -> None:
    """Fresh run: empty the file. Resume: keep only spans of steps up to the checkpoint (the rest re-run)."""
    p = Path(run_dir) / "timeline.jsonl"
    if resume_step is None:
        p.write_text("")
    elif p.exists():
        from gerl.logging.metrics import read_jsonl

        keep = [row for row in read_jsonl(p) if row["step"] <= resume_step]
        p.write_text("".join(json.dumps(row) + "\n" for row in keep))
