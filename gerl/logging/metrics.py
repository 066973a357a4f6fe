"""Run logging: metrics.jsonl (one JSON object per step, the source of truth), TensorBoard, optional wandb."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from gerl.errors import UserError


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; null marks it
    return v


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file this package appends to (metrics.jsonl, timeline.jsonl). A half-written last
    line — the process died mid-write — is left out; a damaged line before it is a UserError naming file and line.
    A missing file has no rows."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise UserError(f"{path} line {i + 1} is not JSON; repair or delete that line, then resume") from None
    return rows


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb: bool, wandb_project: str, config: dict,
                 resume_step: int | None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop lines from steps after the checkpoint: they will be re-run, and must not appear twice.
            keep = [row for row in read_jsonl(self.path) if row.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in keep))
        elif resume_step is None:
            self.path.write_text("")
        self._file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=(resume_step + 1) if resume_step is not None else None)
        self.wandb = None
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                raise UserError("log.wandb=true needs wandb: pip install 'gerl[wandb]' (or set log.wandb=false)") from None
            self.wandb = wb.init(project=wandb_project, config=config, dir=str(self.run_dir), resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_image(self, tag: str, image: Image.Image, step: int) -> None:
        if self.tb is not None:
            self.tb.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb as wb

            self.wandb.log({tag: wb.Image(image)}, step=step)

    def close(self) -> None:
        self._file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
