"""engine.rehearse=true: every GPU launcher's layout on CPU, as real processes — Ray declaring the GPUs, one
CUDA_VISIBLE_DEVICES per host, the GPU backend map with gloo for NCCL, the launcher's fp16 with its loss scaling —
and two Ray nodes in one machine (ray.cluster_utils.Cluster) for cross-node placement, process groups and weight
sync. ocr-mini draws digits the OCR reward tells apart, so the first update has a real gradient to check (the tiny
random model scores 0 everywhere, which the first-update warning then says)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")

from gerl.config import load_config  # noqa: E402
from gerl.engine import dist as gdist  # noqa: E402
from gerl.engine import pool  # noqa: E402
from gerl.engine.resources import own_ray_env  # noqa: E402
from gerl.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "assets" / "ocr_mini"
LAUNCHERS = ["run_sd3_fast_1p_with_reward.sh", "run_sd3_fast_3p_a1_r2.sh", "run_sd3_fast_3p_a2_r1.sh",
             "run_sd3_fast_3p_hybrid.sh", "run_sd3_fast_8p_hybrid_with_reward.sh"]
# The two decoupled launchers are rehearsed across two Ray nodes (tests/engine/test_rehearsal_two_nodes.py), with
# the same checks (check_rehearsal) and the cross-node ones; the other three here, on one node.
DECOUPLED = ["run_sd3_fast_3p_a1_r2.sh", "run_sd3_fast_3p_a2_r1.sh"]
# the 3-host layout last: the pure-NCCL test below then runs on the 3 hosts it left (gerl/engine/pool.py)
ONE_NODE = sorted((name for name in LAUNCHERS if name not in DECOUPLED), key=lambda name: "_3p_" in name)
QUIET = ["log.progress_bar=false", "log.tensorboard=false", "log.images_every=0"]


def env(**extra):
    e = dict(os.environ, RAY_AUTH_MODE="disabled", **extra)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"
    return e


def launcher_config(name: str, model: str = "ocr-mini", data: Path = DATA) -> dict:
    r = subprocess.run(["bash", str(REPO / "recipes" / name), model, str(data), "--print-config"],
                       capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def flat(tree: dict, prefix: str = "") -> dict:
    """A resolved config tree as dotted key → value (reward kwargs stay one mapping)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def rehearse(launcher: str, out: Path, *extra: str) -> None:
    """Train the launcher's own resolved config (its --print-config, through bash) as a rehearsal, in this process
    on the Ray cluster that is up (the launcher's bash → `gerl train` path itself is run by the tiny test below)."""
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in flat(launcher_config(launcher)).items()]
                      + [f"output_dir={out}", "engine.rehearse=true", "max_steps=2", *QUIET, *extra])
    train(cfg)


@pytest.fixture(scope="module")
def declared_gpus():
    """One Ray for the launchers: 8 declared GPUs and the 4 CPUs each GPU host reserves (the largest launcher's
    needs), on this machine's real cores."""
    own_ray_env()
    ray.init(address="local", num_cpus=32, num_gpus=8, include_dashboard=False, log_to_driver=False)
    with pool.kept():
        yield
    ray.shutdown()


def check_rehearsal(launcher: str, out: Path, stderr: str) -> list[dict]:
    """What every launcher's rehearsal must show: its layout, fp16 with GeRL's loss scaling, a real first update on
    the rollout's own log-probs, each host on its own declared GPU (per node) with the GPU backend map. Returns the
    hosts' placement records ([] for the local engine)."""
    assert "gerl: rehearsal of the GPU layout on CPU" in stderr
    want, ran = launcher_config(launcher), yaml.safe_load((out / "config.yaml").read_text())
    layout = ("kind", "hybrid", "actor_workers", "rollout_workers", "schedule", "max_staleness", "gpus_per_worker")
    assert {k: ran["engine"][k] for k in layout} == {k: want["engine"][k] for k in layout}
    assert ran["model"]["dtype"] == want["model"]["dtype"] == "fp16" and ran["conventions"] == want["conventions"]
    first = rows(out)[1]
    assert first["step"] == 1 and first["grad_norm"] > 0 and first["optimizer_steps"] == 2
    assert first["ratio_max_dev_before_update"] <= 1e-3  # rollout and actor compute the same fp16 log-probs
    assert first["loss_scale"] == 2.0**24 and first["overflow_updates_skipped"] == 0  # fp16: GeRL's loss scaling
    g = want["engine"]
    if g["kind"] == "local":
        return []
    hosts = json.loads((out / "placement.json").read_text())
    n = g["actor_workers"] if g["hybrid"] else g["actor_workers"] + g["rollout_workers"]
    assert len(hosts) == n and "peak_mem_gib" in first and first["actor_peak_mem_gib"] > 0
    assert all(len(h["gpu_ids"]) == 1 for h in hosts)
    assert len({(h["node"], h["gpu_ids"][0]) for h in hosts}) == n, "each host on its own GPU"
    assert all(h["cuda_visible_devices"] == h["gpu_ids"][0] and h["device"] == "cpu" and h["dtype"] == "fp16"
               for h in hosts)
    assert all(h["nice"] == 0 for h in hosts), "hosts at the normal priority (gerl.engine.resources.own_ray_env)"
    for h in hosts:  # data-parallel actors share a process group with the GPU map, NCCL played by gloo
        assert h["backends"] == ("cpu:gloo,cuda:gloo" if g["actor_workers"] > 1 and "actor" in h["roles"] else None)
    return hosts


@pytest.mark.parametrize("launcher", ONE_NODE)
def test_every_launcher_rehearses_its_gpu_layout(launcher, tmp_path, declared_gpus, capfd):
    out = tmp_path / "run"
    rehearse(launcher, out)
    hosts = check_rehearsal(launcher, out, capfd.readouterr().err)
    assert len({h["node"] for h in hosts}) <= 1


def test_the_launchers_own_command_with_the_tiny_model(tmp_path):
    """`bash recipes/<launcher>.sh tiny DATA engine.rehearse=true max_steps=2`, the whole command as a user runs it
    (a Ray launcher the same way, starting its own Ray: tests/scripts/test_bench_gpu.py's --launchers test). The
    tiny random model's images all score 0 under OCR: the run says so."""
    out = tmp_path / "run"
    r = subprocess.run(["bash", str(REPO / "recipes" / "run_sd3_fast_1p_with_reward.sh"), "tiny", str(REPO / "assets" / "ocr"),
                        "engine.rehearse=true", "max_steps=2", "validation.every=-1", *QUIET],
                       capture_output=True, text=True, timeout=600, env=env(OUT=str(out)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model.resolution=512→64" in r.stderr, "the shrink is said on stderr"
    assert "WARNING: the first update's gradient norm is 0 because every advantage is 0" in r.stderr
    assert "2 steps, " in r.stdout and "throughput" in r.stdout


def test_a_pure_nccl_group_fails_the_rehearsal_as_it_would_fail_on_gpus(tmp_path, declared_gpus, monkeypatch):
    """The reviewer's crash: a process group started with backend "nccl" alone has no CPU entry, so the
    data-parallel ranks' CPU flag fails at the first optimizer step. The rehearsal keeps that failure."""
    monkeypatch.setattr(gdist, "GPU_BACKENDS", "nccl")  # read by the driver, which hands the map to the hosts
    with pytest.raises(Exception, match="No backend type associated with device type cpu"):
        rehearse("run_sd3_fast_3p_a2_r1.sh", tmp_path, "validation.every=-1", "max_steps=1")


