"""The stage timeline of a real run keeps its invariants, and the report's validator catches broken ones."""

from gerl.logging.report import busy_fractions, last_steps, timeline_problems
from gerl.logging.timeline import read_timeline

TOL = 1e-3  # seconds: rollout spans convert perf_counter to wall time per micro-batch (µs jitter)


def test_real_run_timeline_invariants(report_runs):
    spans = read_timeline(report_runs[0])
    lanes = {s["lane"] for s in spans}
    assert "trainer" in lanes and any(ln.startswith("rollout") for ln in lanes)
    assert any(ln.startswith("reward/jpeg_compressibility") for ln in lanes)
    assert {s["step"] for s in spans} >= {1, 2, 3}
    for s in spans:
        assert s["end"] >= s["start"]
    # Checked directly here (not through the validator under test): same lane + depth never overlap ...
    groups: dict = {}
    for s in spans:
        groups.setdefault((s["lane"], s["depth"]), []).append(s)
    for group in groups.values():
        group.sort(key=lambda s: s["start"])
        for a, b in zip(group, group[1:]):
            assert b["start"] >= a["end"] - TOL, (a, b)
    # ... and each depth-1 span lies inside a depth-0 span of the same lane and step.
    for s in (s for s in spans if s["depth"] == 1):
        assert any(p["lane"] == s["lane"] and p["step"] == s["step"] and p["start"] - TOL <= s["start"]
                   and s["end"] <= p["end"] + TOL for p in groups[(s["lane"], 0)]), s
    assert any(s["depth"] == 1 for s in spans)  # the trainer's stages nest in its "step" spans
    assert timeline_problems(spans) == []


def span(lane, name, step, start, end, depth=0):
    return {"lane": lane, "name": name, "step": step, "start": start, "end": end, "depth": depth}


def test_validator_catches_overlap_orphans_and_reversed_spans():
    good = [span("trainer", "step", 1, 0.0, 10.0), span("trainer", "train", 1, 5.0, 9.0, 1),
            span("rollout", "generate mb0", 1, 0.0, 2.0), span("rollout", "generate mb1", 1, 2.0, 4.0)]
    assert timeline_problems(good) == []
    overlapping = good + [span("rollout", "decode mb0", 1, 3.0, 5.0)]
    problems = timeline_problems(overlapping)
    assert len(problems) == 1 and "overlap" in problems[0] and "rollout" in problems[0]
    orphan = good + [span("trainer", "sync", 1, 9.5, 11.0, 1)]  # sticks out of its step span
    assert any("lies in no depth-0 span" in p for p in timeline_problems(orphan))
    wrong_step = good + [span("trainer", "sync", 2, 9.2, 9.5, 1)]  # inside step 1's span but tagged step 2
    assert any("lies in no depth-0 span" in p for p in timeline_problems(wrong_step))
    reversed_ = good + [span("actor", "train", 1, 5.0, 4.0)]
    assert any("ends before it starts" in p for p in timeline_problems(reversed_))


def test_window_and_busy_fractions():
    spans = [span("trainer", "step", s, 10.0 * s, 10.0 * s + 10) for s in range(1, 6)]
    spans += [span("rollout", "generate mb0", s, 10.0 * s, 10.0 * s + 4) for s in range(1, 6)]
    window = last_steps(spans, 3)
    assert {s["step"] for s in window} == {3, 4, 5}
    busy = busy_fractions(window)
    assert list(busy) == ["trainer", "rollout"]
    assert busy["trainer"] == 1.0 and abs(busy["rollout"] - 0.4) < 1e-9
