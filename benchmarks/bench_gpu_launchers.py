"""Every GPU launcher for 2 steps on ONE GPU, each host on a share of it (engine.gpus_per_worker = 1 / hosts): the
part of benchmarks/bench_gpu.py (`--launchers`) that checks the launchers as they really run, on CUDA.

Each launcher runs as a user runs it (`bash recipes/run_sd3_fast_*.sh MODEL DATA ...`) with ocr-mini (the shipped
model: its digits give the OCR reward something to tell apart, so the first update has a real gradient) at its
native 64 px and 32 T5 tokens, the launcher's own batch, dtype (fp16), schedule, placement and conventions. Per
launcher it reports and checks:
- it exits 0; step 1's grad_norm > 0 and ratio_max_dev_before_update ≤ 1e-3 (rollout and actor agree);
- the driver never initialised CUDA (driver_cuda_initialized, logged by GPU runs of the Ray engine);
- each role's measured peak (actor_peak_mem_gib / rollout_peak_mem_gib, or the local engine's peak_mem_gib)
  next to `gerl plan`'s prediction (plan_peak_gib/<role>), and their ratio.
Hosts sharing one GPU exchange gradients with gloo (NCCL cannot join two ranks on one device), so this checks
function and memory, not multi-GPU speed. Without CUDA (`--device cpu`) the same runs are rehearsals
(engine.rehearse=true): the orchestration and the checks that apply, for the CI test.

    python -m benchmarks gpu --launchers                          # all five, on the GPU
    python -m benchmarks gpu --launchers 3p_a1_r2 --device cpu    # one, rehearsed on CPU
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procgroup import run_group  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = ("1p_with_reward", "3p_a1_r2", "3p_a2_r1", "3p_hybrid", "8p_hybrid_with_reward")
RATIO_BOUND = 1e-3
SMALL = ["model.resolution=64", "model.max_sequence_length=32", "validation.num_prompts=8",
         "sampling.eval_num_steps=10", "log.progress_bar=false", "log.tensorboard=false", "log.images_every=0"]


def _env() -> dict:
    e = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"
    return e


def _hosts(cfg: dict) -> int:
    g = cfg["engine"]
    if g["kind"] == "local":
        return 1
    return g["actor_workers"] if g["hybrid"] else g["actor_workers"] + g["rollout_workers"]


def launcher_args(name: str, model: str, data: Path, cuda: bool) -> tuple[list[str], int]:
    """(the launcher's command line for 2 steps on one GPU, or as a rehearsal without CUDA; its host count)."""
    script = REPO / "recipes" / f"run_sd3_fast_{name}.sh"
    printed = subprocess.run(["bash", str(script), model, str(data), "--print-config"], capture_output=True,
                             text=True, timeout=120, env=_env(), check=True).stdout
    hosts = _hosts(yaml.safe_load(printed))
    share = int(100 / hosts) / 100  # e.g. 0.33 each for 3 hosts: the shares fit one GPU
    layout = ([f"engine.gpus_per_worker={share}", "engine.cpus_per_worker=1"] if cuda and hosts > 1 else
              [] if cuda else ["engine.rehearse=true"])
    return ["bash", str(script), model, str(data), "max_steps=2", *layout, *SMALL], hosts


def run_launcher(name: str, out: Path, model: str = "ocr-mini", data: Path = REPO / "assets" / "ocr_mini",
                 cuda: bool = True, timeout_s: int = 600) -> dict:
    """Run one launcher for 2 steps and read its checks. It runs in its own process group: past `timeout_s`
    bash, `gerl train` and its Ray processes are all killed (benchmarks/_procgroup.py), not bash alone, so nothing
    of it keeps the GPU; the row then has exit None and says so."""
    cmd, hosts = launcher_args(name, model, data, cuda)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        code, stragglers = run_group(cmd, timeout_s, env={**_env(), "OUT": str(out)}, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
    row: dict = {"launcher": name, "hosts": hosts, "exit": code, "wall_s": time.perf_counter() - t0,
                 "command": " ".join(cmd[2:]), "stragglers_killed": stragglers}
    if code is None:
        row["error"] = f"timed out after {timeout_s} s; its process group and every process it started were killed"
        return row
    if code != 0:
        row["error"] = lines[-1][:300] if lines else "no output"
        return row
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in rows if x.get("step") == 1)
    row.update(grad_norm=first.get("grad_norm"), ratio_dev=first.get("ratio_max_dev_before_update"),
               loss_scale=first.get("loss_scale"), driver_cuda=any(x.get("driver_cuda_initialized") for x in rows))
    local = yaml.safe_load((out / "config.yaml").read_text())["engine"]["kind"] == "local"
    measured = {"hybrid": "peak_mem_gib"} if local else {"actor": "actor_peak_mem_gib",
                                                         "rollout": "rollout_peak_mem_gib"}
    memory = {}
    for role, key in measured.items():
        got = max((x[key] for x in rows if x.get(key) is not None), default=None)
        plan = next((x[f"plan_peak_gib/{r}"] for x in rows for r in (role, "hybrid") if f"plan_peak_gib/{r}" in x),
                    None)
        memory[role] = {"measured_gib": got, "plan_gib": plan,
                        "measured_over_plan": got / plan if got is not None and plan else None}
    row["memory"] = memory
    row["ok"] = bool(row["grad_norm"] and row["grad_norm"] > 0 and row["ratio_dev"] is not None
                     and row["ratio_dev"] <= RATIO_BOUND and not row["driver_cuda"])
    return row


def run_all(names, out_dir: Path, cuda: bool) -> list[dict]:
    rows = []
    for name in names:
        rows.append(run_launcher(name, out_dir / name, cuda=cuda))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    if r["exit"] != 0:
        return f"launcher {r['launcher']:<22} FAILED (exit {r['exit']}): {r.get('error')}"
    mem = "; ".join(f"{role} {m['measured_gib']:.2f} GiB measured vs {m['plan_gib']:.2f} planned"
                    if m["measured_gib"] is not None and m["plan_gib"] else
                    f"{role} {m['measured_gib']:.2f} GiB measured (no plan)" if m["measured_gib"] is not None else
                    f"{role} n/a" for role, m in r["memory"].items())
    return (f"launcher {r['launcher']:<22} {'ok  ' if r['ok'] else 'FAIL'} {r['hosts']} host(s) {r['wall_s']:.0f} s; "
            f"step 1 grad_norm {r['grad_norm']:.3g}, max |ratio-1| {r['ratio_dev']:.2g} (bound {RATIO_BOUND:g}), "
            f"loss scale {r['loss_scale']}, driver CUDA {'INITIALISED' if r['driver_cuda'] else 'untouched'}; {mem}")
