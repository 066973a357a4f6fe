"""A run that starts its own Ray stops it: on a normal end, on a failed start, and when the driver is killed with
SIGTERM (real processes: the driver finishes its step, checkpoints, exits 130 and no Ray process outlives it)."""

import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from gerl.engine.resources import own_ray_env  # noqa: E402
from gerl.errors import UserError  # noqa: E402
from gerl.trainer import train  # noqa: E402
from tests.train.helpers import REPO, SMALL_CLI, small_config  # noqa: E402

RAY = ["engine.kind=ray", "engine.device=cpu", "engine.cpus_per_worker=1"]


@pytest.fixture(autouse=True)
def no_ray_running():
    if ray.is_initialized():
        pytest.skip("needs a process without Ray: the run must start its own")
    own_ray_env()
    yield
    if ray.is_initialized():  # the test failed: do not leak Ray into the rest of the session
        ray.shutdown()


def test_a_failed_start_stops_the_ray_it_started(tmp_path):
    cfg = small_config(tmp_path, "max_steps=1", *RAY, "engine.cpus_per_worker=64")
    with pytest.raises(UserError, match="asks for 64 CPUs"):
        train(cfg)
    assert not ray.is_initialized()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _alive(procs):
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_to_the_driver_leaves_no_ray_process_behind(tmp_path):
    run = tmp_path / "run"
    # without the worker niceness set here (the fixture's own_ray_env sets it in this process): the run's own Ray
    # must set it itself
    env = {k: v for k, v in dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled").items()
           if k != "RAY_worker_niceness"}
    proc = subprocess.Popen([sys.executable, "-m", "gerl.cli", "train", *SMALL_CLI, *RAY, f"output_dir={run}",
                             "max_steps=30"], stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    ray_procs = []
    try:
        t0 = time.time()
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.time() - t0 < 400, "no step within 400 s"
            time.sleep(0.5)
        ray_procs = psutil.Process(proc.pid).children(recursive=True)
        assert any(p.name() == "raylet" for p in ray_procs), [p.name() for p in ray_procs]
        hosts = [p for p in ray_procs if p.name().startswith("ray::Host")]
        # the hosts run at the normal priority, not Ray's default niceness of 15 (gerl.engine.resources)
        assert hosts and all(p.nice() == 0 for p in hosts), [(p.name(), p.nice()) for p in ray_procs]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 130, err[-2000:]
        assert "gerl: resume with: gerl train" in err
        deadline = time.time() + 120  # Ray's daemons take seconds to exit; a loaded machine may take many
        while _alive(ray_procs) and time.time() < deadline:
            time.sleep(0.5)
        assert not _alive(ray_procs), sorted(p.name() for p in _alive(ray_procs))
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _alive(ray_procs):  # only the processes this test started
            p.kill()
