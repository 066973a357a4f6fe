"""The CPU allocator's own record of a program's peak, for checking `gerl plan` (tests/test_plan_algorithms.py,
tests/test_plan_families.py): a measure that shares nothing with the planner's storage counter.

The running sum of the allocator's [memory] events (torch.profiler, profile_memory=True), less the scratch a kernel
allocates and frees inside one call: the CPU's fp16 GEMM converts its operands to fp32 (a (64 × 512) @ (512 × 128)
product: 406 KiB of scratch for a 16 KiB output) where cuBLAS works in a workspace allocated once, and neither is what
the plan counts (fake tensors see each op's outputs; docs/plan.md).
"""

from __future__ import annotations

import bisect

# every kernel whose internal scratch is taken out of the measure: the GEMMs and the CPU flash attention
KERNELS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def scratch_free_peak(program, kernels=KERNELS) -> tuple[int, int]:
    """(peak of the allocator's running sum with each `kernels` call's events netted at its end, the raw peak) over
    `program()`, in bytes above what was live when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        program()
    events = list(prof.profiler.kineto_results.events())
    calls = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() in kernels)
    starts = [k[0] for k in calls]
    raw = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    net: dict[int, int] = {}
    kept = []
    for t, n in raw:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= calls[i][1]:
            net[i] = net.get(i, 0) + n
        else:
            kept.append((t, n))
    kept = sorted(kept + [(calls[i][1], n) for i, n in net.items()])

    def peak(evs):
        live = top = 0
        for _, n in evs:
            live += n
            top = max(top, live)
        return top
    return peak(kept), peak(raw)


def existing_bytes(module) -> int:
    """Bytes of a module's distinct parameters and buffers (what exists before a measured program starts)."""
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in unique.values())


def net_bytes(program) -> int:
    """Bytes the allocator holds after `program()` beyond what it held before: its [memory] events summed
    (allocations positive, frees negative)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        program()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
