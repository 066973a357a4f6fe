"""benchmarks/gpu_day.py (the GPU day in one command) rehearsed on CPU: a phase made to fail with --fail is recorded
in gpu_day.json and the phases after it still run, the JSON rewritten after each; its one-line argument errors;
and benchmarks/_procgroup.py, which kills everything a command started when it runs past its cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.scripts import load_script

gpu_day = load_script("gpu_day")
procgroup = load_script("_procgroup")


def test_a_failing_phase_is_recorded_and_the_later_phases_still_run(tmp_path, capsys):
    """env, then smoke made to fail, then train and flux_rollout: all four recorded, train and flux_rollout measured
    after smoke's failure. ≈ 40 s on 2 cores (each phase is a child process: torch imports, the tiny SD3 built for
    train, the tiny FLUX for flux_rollout)."""
    assert gpu_day.main(["--rehearse", "--out", str(tmp_path), "--phases", "flux_rollout,train,smoke,env",
                         "--fail", "smoke"]) == 1
    report = json.loads((tmp_path / "gpu_day.json").read_text())
    phases = report["phases"]
    assert list(phases) == ["env", "smoke", "train", "flux_rollout"]  # the registry's order, whatever --phases said
    assert phases["smoke"]["status"] == "failed"
    assert phases["smoke"]["error"] == "RuntimeError: --fail smoke: this phase fails on purpose"
    assert phases["env"]["status"] == "ok" and phases["env"]["torch_version"] and phases["env"]["matmul_tflops"] > 0
    assert report["env"]["torch_version"] == phases["env"]["torch_version"]  # the env phase's numbers head the JSON
    t = phases["train"]
    assert t["status"] == "ok" and t["checkpointing_off"]["update_s"] > 0 and t["checkpointing_on"]["update_s"] > 0
    assert t["checkpointing_off"]["ratio_max_dev"] <= 1e-3
    assert all(p["seconds"] > 0 for p in (phases["env"], phases["train"]))
    f = phases["flux_rollout"]  # tiny-flux through the fast init, ours vs the stock FluxPipeline at two sizes
    assert f["status"] == "ok" and f["dtype"] == "fp32" and f["settings"]["guidance_scale"] == 3.5
    assert [(r["resolution"], r["image_tokens"], r["steps"]) for r in f["rows"]] == [(64, 64, 6), (128, 256, 6)]
    assert all(r["ours_images_per_s"] > 0 and r["stock_images_per_s"] > 0 and r["ours_latents_finite"]
               and r["tflop_per_image_forward"] > 0 for r in f["rows"])
    # each row's ratio is of its times, images/s of its images: the same quotient but for the last bit
    lowest = min(r["ours_images_per_s"] / r["stock_images_per_s"] for r in f["rows"])
    assert f["min_ratio"] == pytest.approx(lowest, rel=1e-12)
    # the JSON was rewritten after each phase, before the next one started
    log = [ln for ln in (tmp_path / "gpu_day.log").read_text().splitlines() if ln.startswith("[gpu_day]")]
    order = [ln.split(" — ")[0] for ln in log if "rewritten after" in ln or ": start" in ln]
    assert order == ["[gpu_day] gpu_day.json rewritten after start", "[gpu_day] env: start (cap 60 s)",
                     "[gpu_day] gpu_day.json rewritten after env", "[gpu_day] smoke: start (cap 90 s)",
                     "[gpu_day] gpu_day.json rewritten after smoke", "[gpu_day] train: start (cap 90 s)",
                     "[gpu_day] gpu_day.json rewritten after train", "[gpu_day] flux_rollout: start (cap 60 s)",
                     "[gpu_day] gpu_day.json rewritten after flux_rollout",
                     "[gpu_day] gpu_day.json rewritten after the last phase"]
    assert "not ok: smoke" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--phases", "env,warp"],
     "unknown phase 'warp'; choose from env, smoke, train, step8, rollout, ratio, step, algos, fsdp, profile, ocr, t5, "
     "validation, fp16, flux_rollout, launcher, launchers"),
    (["--fail", "nope"], "unknown phase 'nope'"),
    (["--phases", ","], "--phases names no phase"),
    (["--deadline-s", "-1"], "--deadline-s must be > 0"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    assert gpu_day.main(["--rehearse", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err
    assert not (tmp_path / "gpu_day.json").exists()
    with pytest.raises(SystemExit):  # no abbreviations: --rehe is not --rehearse
        gpu_day.main(["--rehe", "--out", str(tmp_path)])


def test_without_phases_a_gpu_run_is_a_prepared_call_with_env_first_and_a_rehearsal_runs_both_calls(tmp_path):
    """The third GPU day's two calls (docs/offline_install.md); env heads every call, named or not."""
    first, _ = gpu_day.parse_args(["--out", str(tmp_path)])
    second, _ = gpu_day.parse_args(["--out", str(tmp_path), "--call", "2"])
    every, _ = gpu_day.parse_args(["--out", str(tmp_path), "--rehearse"])
    named, _ = gpu_day.parse_args(["--out", str(tmp_path), "--phases", "launcher,flux_rollout"])
    assert first.names == ["env", "step8", "rollout", "ratio"]
    assert second.names == ["env", "step", "algos", "fsdp", "profile", "ocr", "t5", "validation"]
    assert every.names == ["env", "step8", "rollout", "ratio", "step", "algos", "fsdp", "profile", "ocr", "t5",
                           "validation"]
    assert named.names == ["env", "flux_rollout", "launcher"]


def test_an_unwritable_out_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert gpu_day.main(["--rehearse", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot write to --out" in err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_timeout_kills_every_process_the_command_started(tmp_path):
    """bash starting a child in its group and one in a session of its own (as a daemon or a re-parented worker
    would be): both die with the timeout, and a straggler of a command that exited on its own is killed too."""
    pids = tmp_path / "pids"
    # the second pid is written from inside the new session, so a written pid is one that has left bash's group; a
    # child still in it when the timeout strikes would die with the group and be no straggler. The timeout leaves a
    # loaded machine time to get there (it was 2 s).
    script = f"sleep 300 & echo $! >> {pids}; setsid sh -c 'echo $$ >> {pids}; exec sleep 300' & wait"
    timeout_s = 10
    t = time.monotonic()
    code, stragglers = procgroup.run_group(["bash", "-c", script], timeout_s=timeout_s)
    assert code is None and time.monotonic() - t < 60
    started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    assert len(started) == 2, f"the two sleeps were not both started within the {timeout_s} s timeout: {started}"
    assert not any(_alive(p) for p in started), started
    assert stragglers == 1  # the setsid one: out of the group, found by its marker

    pids.unlink()
    code, stragglers = procgroup.run_group(["bash", "-c", f"setsid sleep 300 & echo $! >> {pids}"], timeout_s=30)
    left = int(pids.read_text())
    assert code == 0 and stragglers == 1 and not _alive(left)


def _own_sessions(pids: list[int], bash: int) -> list[int]:
    """Those of `pids`, bash excepted (it leads the session Popen started), that lead a session of their own: they
    have called setsid(). One gone meanwhile is none."""
    leaders = []
    for p in pids:
        try:
            if p != bash and os.getsid(p) == p:
                leaders.append(p)
        except ProcessLookupError:
            pass
    return leaders


def _wait_for_group_and_session(token: str, bash: int, timeout_s: float = 60.0) -> list[int]:
    """Wait until the processes of `bash -c "sleep 300 & setsid sleep 300 & wait"` (marked `token`, bash's pid
    `bash`) are in the state a test of them needs: 3 of them, one of which has called setsid(). Three marked
    processes are not enough: the one bash forks for `setsid` is counted before it leaves bash's group, and a loaded
    machine may take a while to run it that far (a fresh clone's suite saw 3 in the group for 2). Returns the
    marked pids; fails with what it saw after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = procgroup.marked_pids(token)
        if len(pids) == 3 and len(_own_sessions(pids, bash)) == 1:
            return pids
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:.0f} s the marked processes {pids} are not bash ({bash}), a sleep "
                                 f"in its group and a sleep in a session of its own (in their own sessions: "
                                 f"{_own_sessions(pids, bash)})")
        time.sleep(0.05)


# the setsid child as a loaded machine runs it: forked at once, setsid() only a while later (a loop of bash builtins
# forks nothing, so the marked processes are the same three)
LATE_SETSID = "sleep 300 & (i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; exec setsid sleep 300) & wait"


@pytest.mark.parametrize("script", ["sleep 300 & setsid sleep 300 & wait", LATE_SETSID], ids=["as-is", "late-setsid"])
def test_a_dying_member_of_the_killed_group_is_no_straggler(script):
    """After a timeout the group gets SIGKILL and then the marker sweep runs; on a busy machine a member of the group
    may still be there (signalled, not yet scheduled to die). The sweep kills it but does not count it: only a
    process outside the group (its own session) is a straggler. Here the group is left alive on purpose, so both of
    its processes are what a dying member looks like to the sweep (the CI run of 2026-11-27 counted 2 for 1).
    late-setsid: the race a fresh clone's suite lost (2026-11-28), made certain; waiting for 3 marked processes
    instead of the setsid fails it."""
    env, token = procgroup.marked_env({"PATH": os.environ["PATH"]})
    proc = subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)
    try:
        pids = _wait_for_group_and_session(token, proc.pid)
        assert len(pids) == 3 and sum(os.getpgid(p) == proc.pid for p in pids) == 2, pids
        assert procgroup.sweep(token, killed_group=proc.pid) == 1  # the setsid sleep only
        assert not procgroup.marked_pids(token) and not any(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
        procgroup.sweep(token)  # after a failed assertion too: the setsid sleep is out of bash's reach


def test_markers_nest():
    """A marked command that runs another keeps the outer marker: the outer sweep reaches the inner processes."""
    env, outer = procgroup.marked_env({"PATH": os.environ["PATH"]})
    inner_env, inner = procgroup.marked_env(env)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=inner_env)
    try:
        deadline = time.monotonic() + 10
        while p.pid not in procgroup.marked_pids(outer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.pid in procgroup.marked_pids(outer) and p.pid in procgroup.marked_pids(inner)
    finally:
        p.kill()
        p.wait()
