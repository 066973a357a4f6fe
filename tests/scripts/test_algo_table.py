"""benchmarks/algo_table.py's arithmetic, against hand-worked values: the core-minute clock, the grid readings, the
paired gains, the × sooner ratio with its delta-method error (the published AWM-vs-Flow-GRPO-Fast figure), the
plateau (ceiling) table, and --extend's resume command. No model runs here; the runs themselves are the benchmark."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.scripts import load_script

at = load_script("algo_table")


def _args(**kw) -> argparse.Namespace:
    base = dict(cores=2, grid=2.5, target=0.15, budgets=[5.0, 10.0], images_per_prompt=2, reference="grpo",
                plateau_from=0.0, extend=False, every=5, overrides=[], budget=10.0)
    return argparse.Namespace(**{**base, **kw})


def test_core_minutes_are_cores_times_the_summed_step_times():
    rows = [{"step": 0, "val_reward_mean": 0.3}, {"step": 1, "step_s": 30.0}, {"step": 2, "step_s": 30.0},
            {"step": 3, "step_s": 60.0}]
    assert at.core_minutes(rows, 2) == {1: 1.0, 2: 2.0, 3: 4.0}
    assert at.core_minutes(rows, 1) == {1: 0.5, 2: 1.0, 3: 2.0}


def test_a_grid_point_reads_the_last_step_at_or_before_it():
    minutes = {1: 1.0, 2: 2.0, 3: 4.0, 4: 4.5}
    assert at.grid_steps(minutes, 1.0) == {1.0: 1, 2.0: 2, 3.0: 2, 4.0: 3}  # nothing new at 3: step 2 again
    assert at.grid_steps(minutes, 2.5) == {2.5: 2}  # 4.5 < 5: no reading at 5
    assert at.grid_steps({1: 3.0}, 2.5) == {}  # no step by the first grid point: no reading there


def _run_dir(tmp_path, name, step_s, scores, base):
    run = tmp_path / name
    (run / "checkpoints").mkdir(parents=True)
    run.joinpath("metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": i + 1, "step_s": s}) for i, s in enumerate(step_s)) + "\n")
    run.joinpath("test_eval.json").write_text(json.dumps({"base": base, "steps": scores}))
    return run


def test_a_run_is_read_on_the_grid_with_gains_paired_by_prompt(tmp_path):
    # 2 cores, 75 s a step: 2.5 core-minutes per step. Two prompts × 2 images; base 0.2/0.4 and 0.0/0.0.
    base = [0.2, 0.4, 0.0, 0.0]
    scores = {"1": [0.3, 0.5, 0.0, 0.1],     # gains per prompt: +0.1, +0.05 → mean +0.075
              "2": [0.4, 0.6, 0.1, 0.3],     # +0.2, +0.2 → +0.2
              "3": [0.1, 0.3, 0.3, 0.3]}     # −0.1, +0.3 → +0.1
    r = at.summarize_run(_run_dir(tmp_path, "awm_async1_seed0", [75.0, 75.0, 75.0], scores, base), _args())
    assert [c["grid_min"] for c in r["curve"]] == [2.5, 5.0, 7.5]
    assert [c["gain"] for c in r["curve"]] == pytest.approx([0.075, 0.2, 0.1])
    assert r["curve"][0]["stderr"] == pytest.approx(0.025)  # |0.1 − 0.05| / 2: the standard error over 2 prompts
    assert r["core_min_to_target"] == 5.0  # the first reading at +0.15 or above, not the best
    assert r["gain_at"] == {5.0: pytest.approx(0.2), 10.0: None}  # 7.5 core-minutes run: nothing at 10
    assert r["spent"] == pytest.approx(7.5) and r["steps"] == 3 and r["s_per_step"] == pytest.approx(75.0)
    assert r["base_test"] == pytest.approx(0.15)


def _summary(name, reached, spent, gain_at=None, curve=None):
    return {"run": name, "core_min_to_target": reached, "spent": spent, "gain_at": gain_at or {},
            "curve": curve or [], "s_per_step": 1.0, "base_test": 0.277}


def test_the_ratio_is_the_ratio_of_mean_times_with_its_delta_method_error():
    # The published reading (docs/benchmarks.md): AWM 5, 10, 10 against Flow-GRPO-Fast 22.5, 22.5, 20.
    # Means 8.333 and 21.667; standard errors sqrt(8.333/3) = 1.667 and sqrt(2.083/3) = 0.833;
    # ratio 2.600, relative error sqrt((1.667/8.333)² + (0.833/21.667)²) = 0.2037 → ± 0.53.
    results = {"grpo|async:1": [_summary(f"g{i}", t, 40.0) for i, t in enumerate([22.5, 22.5, 20.0])],
               "awm|async:1": [_summary(f"a{i}", t, 20.0) for i, t in enumerate([5.0, 10.0, 10.0])]}
    row = next(ln for ln in at.ratio_table(results, _args()).splitlines() if ln.startswith("| AWM"))
    assert row == "| AWM | async:1 | 8.3 ± 1.7 | async:1 | 21.7 ± 0.8 | 2.60 ± 0.53 |"


def test_a_reference_that_never_got_there_makes_the_ratio_a_lower_bound():
    # a Flow-GRPO-Fast seed still short of the target at 40 counts at 40: the mean 27.5 is a lower bound, and so
    # is the ratio 27.5 / 8.333 = 3.3
    results = {"grpo|sync": [_summary("g0", 22.5, 40.0), _summary("g1", None, 40.3), _summary("g2", 20.0, 40.0)],
               "awm|async:1": [_summary(f"a{i}", t, 20.0) for i, t in enumerate([5.0, 10.0, 10.0])]}
    row = next(ln for ln in at.ratio_table(results, _args()).splitlines() if ln.startswith("| AWM"))
    assert row == "| AWM | async:1 | 8.3 ± 1.7 | sync | ≥ 27.5 | ≥ 3.30 |"


def test_the_plateau_is_the_mean_of_each_long_runs_late_readings_and_the_rise_before_it():
    def curve(gains):  # readings every 10 core-minutes from 10
        return [{"grid_min": 10.0 * (i + 1), "gain": g} for i, g in enumerate(gains)]

    long0 = _summary("a0", 5.0, 60.0, {10.0: 0.18, 20.0: 0.22}, curve([0.18, 0.22, 0.25, 0.27, 0.26, 0.28]))
    long1 = _summary("a1", 10.0, 60.0, {10.0: 0.14, 20.0: 0.20}, curve([0.14, 0.20, 0.24, 0.24, 0.28, 0.26]))
    short = _summary("a2", 10.0, 20.0, {10.0: 0.30, 20.0: 0.30}, curve([0.30, 0.30]))  # not past 40: left out
    md = at.plateau_table({"awm|async:1": [long0, long1, short]}, _args(plateau_from=40.0, budgets=[10.0, 20.0]))
    row = md.splitlines()[2]
    # after 40 (50, 60): run means 0.27 and 0.27 → 0.270 ± 0.000; the 20 before, (20, 40] (30, 40): 0.26 and
    # 0.24 → rises 0.01 and 0.03 → +0.020 ± 0.010; at 10: (0.18 + 0.14) / 2 = 0.16 → 59 % of 0.27; at 20: 0.21 → 78 %
    assert row == "| AWM | async:1 | 2 | 2, 2 | +0.270 ± 0.000 | +0.020 ± 0.010 | +0.160: 59% | +0.210: 78% |"


def test_extend_resumes_a_run_that_has_checkpoints_and_starts_over_otherwise(tmp_path):
    run = tmp_path / "awm_async1_seed0"
    fresh = at.train_command(run, "awm", "async:1", 0, _args(grid=2.5), extend=False)
    more = at.train_command(run, "awm", "async:1", 0, _args(grid=2.5), extend=True)
    assert "overwrite=true" in fresh and "resume=true" not in fresh
    assert "resume=true" in more and "overwrite=true" not in more  # overwrite would discard the run being extended
    assert [a for a in fresh if a not in ("overwrite=true",)] == [a for a in more if a != "resume=true"]
    assert "engine.max_staleness=1" in more and "checkpoint.every=1" in more and "seed=0" in more
