"""Ctrl-C / `kill` of a real training process: it finishes the step, checkpoints, prints the exact resume command
and exits 130; that command continues the run. Off a terminal, progress is plain lines, not tqdm's \\r stream."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

from tests.train.helpers import REPO, SMALL_CLI as CLI


def _wait_for_rows(path, n, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists() and len([ln for ln in path.read_text().splitlines() if ln.strip()]) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} metrics rows within {timeout} s")


def test_sigint_checkpoints_at_the_step_boundary_and_prints_the_resume_command(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # log.progress_bar keeps its default (true): stderr is a pipe here, so plain lines must appear instead
    argv = [*CLI, f"output_dir={run}", "max_steps=50", "checkpoint.every=0", "log.print_every=1"]
    argv = [a for a in argv if a != "log.progress_bar=false"]
    proc = subprocess.Popen([sys.executable, "-m", "gerl.cli", "train", *argv], stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        _wait_for_rows(run / "metrics.jsonl", 1, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    k = rows[-1]["step"]
    assert 1 <= k < 50 and [r["step"] for r in rows] == list(range(1, k + 1))
    assert (run / "checkpoints" / f"step_{k:06d}" / "trainable.safetensors").is_file()
    assert "SIGINT received: stopping after this step" in err
    assert f"gerl: step {k}/50 reward_mean=" in err and "\r" not in err  # plain lines, no tqdm stream
    (line,) = [ln for ln in err.splitlines() if ln.startswith("gerl: resume with: ")]
    cmd = shlex.split(line[len("gerl: resume with: "):])
    assert cmd[:2] == ["gerl", "train"] and cmd[-1] == "resume=true"
    # the printed command resumes the run (with one more step, to keep the test short)
    r = subprocess.run([sys.executable, "-m", "gerl.cli", *cmd[1:], f"max_steps={k + 1}"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, k + 2))
