"""The asynchronous strategies side by side at equal resources (the same CPU cores): seconds per step, speed-up
against sync, and efficiency against an ideal built from stage times measured in isolation on each mode's own
resources; then, from each run's timeline.jsonl, which stage shared which core with which.

Modes (each a `gerl train` subprocess on the first --cores cores; tiny SD3 unless overridden):
  sync          local, both cores, rewards scored after generation (with_reward off)
  with_reward   local, both cores, each micro-batch's reward submitted as a future while generation goes on
  one_step_off  Ray, actor on cores/2 + rollout (with its reward thread) on the other cores/2; batch t+1 is
                generated while batch t trains (max_staleness 1)
  stale2        as one_step_off with max_staleness 2
  hybrid        Ray, one colocated actor+rollout worker on all cores (with_reward on)

Isolated stage times ("profiles", with_reward off so nothing overlaps): on all cores they are the sync mode's own
medians; on cores/2 a separate sync run pinned to those cores measures them. Ideal step time per mode:
  sync               gen + decode + reward + train                           (all cores; efficiency 1 by design)
  with_reward/hybrid gen + decode + reward / micro-batches + train           (all cores)
  one_step_off/k     max(gen + decode + reward / micro-batches, train + sync) (cores/2 each)
Speed-up = sync step / mode step, measured in the same invocation.

Rewards: --reward ocr (rapidocr in a thread of the rollout process: it needs local CPU) or --reward remote
(scripts/remote_reward.py, a server process on 127.0.0.1 that sleeps --latency s per micro-batch: the latency costs
no local CPU, like a VLM or OCR service on another machine). --reward jpeg is the cheap in-process reward.

    python -m benchmarks async [--steps 6] [--reward ocr|remote|jpeg] [--latency 0.25]
                               [--modes sync,with_reward,one_step_off,stale2,hybrid] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["engine.kind=local", "engine.hybrid=true", "engine.schedule=sync", "reward.with_reward=false"],
    "with_reward": ["engine.kind=local", "engine.hybrid=true", "engine.schedule=sync", "reward.with_reward=true"],
    "one_step_off": ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker={half}",
                     "engine.schedule=async", "engine.max_staleness=1", "reward.with_reward=true"],
    "stale2": ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker={half}",
               "engine.schedule=async", "engine.max_staleness=2", "reward.with_reward=true"],
    "hybrid": ["engine.kind=ray", "engine.hybrid=true", "engine.device=cpu", "engine.cpus_per_worker={all}",
               "engine.schedule=sync", "reward.with_reward=true"],
}
DECOUPLED = ("one_step_off", "stale2")
COMMON = ["log.tensorboard=false", "log.progress_bar=false", "validation.every=-1", "checkpoint.every=0",
          "log.images_every=0", "overwrite=true", "engine.actor_workers=1", "engine.rollout_workers=1"]
GEN_STAGES = ("generate", "decode")


# ------------------------------------------------------------------ pure arithmetic over metrics rows and spans

def medians(rows: list[dict], keys=("step_s", "generate_s", "decode_s", "reward_wait_s", "reward_compute_s",
                                    "train_s", "sync_s", "policy_lag")) -> dict[str, float]:
    """Median of each key over the rows (a missing key counts as 0)."""
    return {k: statistics.median(float(r.get(k, 0.0)) for r in rows) for k in keys}


def ideal_step_s(mode: str, profile: dict[str, float], n_mb: int, sync_s: float = 0.0) -> float:
    """The mode's step time with perfect overlap, from isolated stage times on the mode's own resources.

    Args:
        profile: medians of generate_s, decode_s, reward_compute_s, train_s measured with nothing overlapping
            (with_reward off), on the cores the mode's rollout and actor each get.
        n_mb: rollout micro-batches per step (only the last one's reward is left exposed by with_reward).
        sync_s: the mode's own weight-sync time (decoupled modes).
    """
    gen = profile["generate_s"] + profile["decode_s"]
    if mode == "sync":
        return gen + profile["reward_compute_s"] + profile["train_s"]
    if mode in DECOUPLED:
        return max(gen + profile["reward_compute_s"] / n_mb, profile["train_s"] + sync_s)
    return gen + profile["reward_compute_s"] / n_mb + profile["train_s"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def stage_spans(spans: list[dict], t0: float, t1: float) -> dict[str, list[tuple[float, float]]]:
    """Busy intervals (merged, clipped to [t0, t1]) of each stage, from timeline.jsonl spans of any lane:
    gen = rollout generate/decode, reward = reward-lane calls, train = actor-lane updates."""
    groups: dict[str, list] = {"gen": [], "reward": [], "train": []}
    for s in spans:
        a, b = max(s["start"], t0), min(s["end"], t1)
        if b <= a:
            continue
        lane, stage = s["lane"], s["name"].split(" ")[0]
        if lane.startswith("rollout") and stage in GEN_STAGES:
            groups["gen"].append((a, b))
        elif "reward/" in lane:
            groups["reward"].append((a, b))
        elif lane.startswith("actor") and stage == "train":
            groups["train"].append((a, b))
    return {k: _union(v) for k, v in groups.items()}


def contention(spans: list[dict], t0: float, t1: float, steps: int) -> dict[str, float]:
    """Seconds per step in [t0, t1] that each stage was busy, and that two stages ran at the same time
    (gen∥reward, gen∥train): with CPU-bound stages on shared cores, those seconds are where they contend."""
    g = stage_spans(spans, t0, t1)
    per = lambda iv: _length(iv) / max(steps, 1)  # noqa: E731
    return {"gen": per(g["gen"]), "reward": per(g["reward"]), "train": per(g["train"]),
            "gen_reward": per(_intersect(g["gen"], g["reward"])), "gen_train": per(_intersect(g["gen"], g["train"])),
            "window": (t1 - t0) / max(steps, 1)}


def measured_window(spans: list[dict], first_step: int) -> tuple[float, float, int]:
    """(start, end, steps) of the trainer's depth-0 "step" spans from `first_step` on."""
    steps = [s for s in spans if s["lane"] == "trainer" and s["name"] == "step" and s["depth"] == 0
             and s["step"] >= first_step]
    if not steps:
        raise ValueError(f"no trainer step spans from step {first_step} on")
    return min(s["start"] for s in steps), max(s["end"] for s in steps), len(steps)


# ------------------------------------------------------------------ running

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mode(mode: str, cores: list[int], steps: int, overrides: list[str], out: Path, recipe: str) -> Path:
    """One `gerl train` subprocess pinned to `cores`; returns its run directory."""
    half, allc = max(len(cores) // 2, 1), len(cores)
    mode_args = [a.format(half=half, all=allc) for a in MODES[mode if mode in MODES else "sync"]]
    run_dir = out / mode
    cmd = [sys.executable, "-m", "gerl.cli", "train", recipe, f"output_dir={run_dir}", f"max_steps={steps}",
           *COMMON, *mode_args, *overrides]
    env = dict(os.environ, RAY_AUTH_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, set(cores)))
    if proc.returncode != 0:
        sys.exit(f"bench_async: mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_dir


def start_remote(latency: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "remote_reward.py"), "--latency", str(latency)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "PORT":
        proc.kill()
        sys.exit("bench_async: the remote reward server did not start")
    return proc, f"http://127.0.0.1:{line[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=6, help="steps per mode; the first (warm-up) ones are not measured")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reward", choices=["ocr", "remote", "jpeg"], default="ocr")
    ap.add_argument("--latency", type=float, default=0.25, help="--reward remote: seconds per micro-batch request")
    ap.add_argument("--cores", type=int, default=2, help="cores every mode gets (the first N of this machine)")
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--keep", default="", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every mode")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    avail = sorted(os.sched_getaffinity(0))
    if unknown or args.cores < 2 or args.cores > len(avail) or args.steps < 3:
        print(f"bench_async: need --modes from {','.join(MODES)} (unknown: {unknown}), 2 ≤ --cores ≤ {len(avail)} "
              f"and --steps ≥ 3", file=sys.stderr)
        return 2
    if "sync" not in modes:
        modes = ["sync", *modes]  # the speed-up's reference and the all-cores isolated profile
    cores = avail[:args.cores]
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gerl_bench_async_"))
    out.mkdir(parents=True, exist_ok=True)
    server = None
    reward = {"ocr": ["reward.name=ocr"], "jpeg": ["reward.name=jpeg_compressibility"]}.get(args.reward)
    if args.reward == "remote":
        server, url = start_remote(args.latency)
        reward = ["reward.name=scripts.remote_reward:remote_reward", f"reward.kwargs={{url: '{url}'}}"]
    overrides = [*reward, *args.overrides]
    try:
        from gerl.config import load_config

        cfg = load_config(str(REPO / args.recipe), [o for o in overrides if not o.startswith("reward.kwargs")])
        n_mb = cfg.data.prompts_per_step * cfg.data.group_size // cfg.sampling.micro_batch_size
        half = cores[:len(cores) // 2]
        print(f"{cfg.data.prompts_per_step}x{cfg.data.group_size} images/step at {cfg.model.resolution}px, {n_mb} "
              f"micro-batches, reward {args.reward}"
              + (f" ({args.latency:g} s per micro-batch, served by another process)" if server else "")
              + f", cores {cores}, {args.steps} steps per mode (the first 1-2 are warm-up), medians", flush=True)
        print(f"load average (1 min) at the start: {os.getloadavg()[0]:.1f} (other jobs share these cores when it "
              f"is above {len(cores)})", flush=True)
        res: dict[str, dict] = {}
        for mode in modes:
            run_dir = run_mode(mode, cores, args.steps, overrides, out, args.recipe)
            skip = 2 if mode == "stale2" else 1  # warm-up: model/OCR load, and the pipeline filling up
            rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_s" in r and r["step"] > skip]
            spans = read_jsonl(run_dir / "timeline.jsonl")
            t0, t1, n = measured_window(spans, skip + 1)
            res[mode] = {"med": medians(rows), "why": contention(spans, t0, t1, n)}
            print(f"  {mode} done; load average (1 min) {os.getloadavg()[0]:.1f}", flush=True)
        # Isolated stage times on half the cores: a sync run pinned there (what each decoupled role gets).
        profiles = {"all": res["sync"]["med"]}
        if any(m in DECOUPLED for m in modes):
            run_dir = run_mode("isolated_half", half, args.steps, [*overrides], out, args.recipe)
            rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_s" in r and r["step"] > 1]
            profiles["half"] = medians(rows)
        print_tables(res, profiles, n_mb, len(cores))
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return 0


def print_tables(res: dict, profiles: dict, n_mb: int, ncores: int) -> None:
    sync = res["sync"]["med"]["step_s"]
    h = ncores // 2
    p = {k: v["generate_s"] + v["decode_s"] for k, v in profiles.items()}
    print("\nisolated stage times (with_reward off, one stage at a time), s:")
    for k, v in profiles.items():
        print(f"  {ncores if k == 'all' else h} core(s): gen+decode {p[k]:.3f}  reward {v['reward_compute_s']:.3f}  "
              f"train {v['train_s']:.3f}")
    print(f"\n| mode | cores (actor / rollout) | step s | speed-up vs sync | ideal s | efficiency | gen+decode s | "
          f"reward wait s | reward s | train s | sync s | lag |\n|{' --- |' * 12}")
    for mode, r in res.items():
        m = r["med"]
        prof = profiles["half" if mode in DECOUPLED else "all"]
        ideal = ideal_step_s(mode, prof, n_mb, m["sync_s"])
        where = f"{h} / {h}" if mode in DECOUPLED else f"{ncores} shared"
        print(f"| {mode} | {where} | {m['step_s']:.3f} | {sync / m['step_s']:.2f}× | {ideal:.3f} | "
              f"{ideal / m['step_s']:.2f} | {m['generate_s'] + m['decode_s']:.3f} | {m['reward_wait_s']:.3f} | "
              f"{m['reward_compute_s']:.3f} | {m['train_s']:.3f} | {m['sync_s']:.3f} | {m['policy_lag']:.0f} |")
    print("\nwhere the time went, from timeline.jsonl (seconds per measured step, mean over the measured window; "
          "'∥' = both running at once, on the cores named in 'who shares a core'):")
    print(f"| mode | who shares a core | step s | gen+decode busy | reward busy | train busy | gen ∥ reward | "
          f"gen ∥ train | gen+decode vs isolated |\n|{' --- |' * 9}")
    for mode, r in res.items():
        w = r["why"]
        iso = p["half" if mode in DECOUPLED else "all"]
        who = ("actor: train alone; rollout: gen + reward" if mode in DECOUPLED
               else "gen, reward, train all on all cores")
        print(f"| {mode} | {who} | {w['window']:.3f} | {w['gen']:.3f} | {w['reward']:.3f} | {w['train']:.3f} | "
              f"{w['gen_reward']:.3f} | {w['gen_train']:.3f} | {r['med']['generate_s'] + r['med']['decode_s']:.3f}"
              f" vs {iso:.3f} ({(r['med']['generate_s'] + r['med']['decode_s']) / iso:.2f}×) |")


if __name__ == "__main__":
    sys.exit(main())
