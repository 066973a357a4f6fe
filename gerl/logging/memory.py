"""Where GPU memory goes: resident bytes per module, optimizer state, and the peak of each named stage of a step."""

from __future__ import annotations

from contextlib import contextmanager

import torch

GIB = 2**30


def module_gib(module: torch.nn.Module) -> float:
    """Parameters + buffers of `module`, GiB (a shared tensor counts once; the transformer's positional-embedding
    table is a buffer, 0.42 GiB in bf16 for SD3.5-M, and is resident like any weight)."""
    tensors = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / GIB


def optimizer_state_gib(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer's state tensors (AdamW: exp_avg and exp_avg_sq per trained parameter), GiB; 0 before a step."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)) / GIB


class StagePeaks:
    """Peak allocated CUDA memory of each named stage (the max over all its occurrences) and of the whole run.

    Each `stage(name)` resets the allocator's peak on entry (to what is allocated then: the resident weights and
    whatever the step holds) and reads it on exit, so a stage's peak includes everything resident while it ran;
    its transient is that peak minus what was allocated on entry (what `gerl plan` predicts per phase).
    The run's peak is the largest reading, and the peak before the first stage. On a CPU device every peak is None.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peaks: dict[str, float | None] = {}  # stage → GiB, in the order the stages first ran
        self.transient: dict[str, float | None] = {}  # stage → the largest (peak − allocated on entry), GiB
        self.overall = torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None

    @contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            entry = torch.cuda.memory_allocated(self.device) / GIB
        try:
            yield
        finally:
            if self.cuda:
                peak = torch.cuda.max_memory_allocated(self.device) / GIB
                self.peaks[name] = max(self.peaks.get(name) or 0.0, peak)
                self.transient[name] = max(self.transient.get(name) or 0.0, peak - entry)
                self.overall = max(self.overall, peak)
            else:
                self.peaks.setdefault(name, None)
                self.transient.setdefault(name, None)
