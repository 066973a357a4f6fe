"""The GPU day in one command: every decision-relevant GPU number in one prepared call, phase by phase, saved
after each.

    bash scripts/gpu_day.sh "$OUT"                       # on the lent GPU machine: install the bundle, then all
    python -m benchmarks gpu_day --out DIR               # the phases on the GPU (needs diffusers; Ray for launcher)
    python -m benchmarks gpu_day --out DIR --rehearse    # the same phases on CPU at tiny / ocr-mini shapes
    python -m benchmarks gpu_day --out DIR --phases env,smoke --fail env    # a chosen subset; one made to fail

Phases run in the order of benchmarks/_gpu_day_phases.py's registry (the order of value), env first in every call;
without --phases a GPU run takes the phases of `--call N` (1 by default; docs/offline_install.md has both calls),
a rehearsal those of every call. Each runs in a child process of its own, in a process group of its own, under its own time
cap (cut to what is left of --deadline-s) and exception guard: a phase that fails, raises or runs past its cap is
recorded as such (its process group and every process it started killed, benchmarks/_procgroup.py) and the next
phase runs. After every phase DIR/gpu_day.json is rewritten:

    {"env": {...}, "phases": {NAME: {"status": "ok|failed|timeout|skipped|pending", "seconds": s,
                                      ...numbers, "error": last line}}}

and DIR/gpu_day.log gets the phase's whole output (appended as it runs). A phase's numbers measured before a
failure or a timeout are kept. The exit code is 0 when no phase failed or timed out, 1 otherwise, 2 for bad
arguments. docs/benchmarks.md ("gpu_day") lists each phase's numbers, caps and H100 estimates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from _gpu_day_phases import PHASES, PhaseFailed, run_phase  # noqa: E402
from _procgroup import run_group  # noqa: E402

RESULT_ENV = "GERL_GPU_DAY_RESULT"  # where a phase's child writes its numbers (a temp file, not DIR: 8 files return)
MIN_CAP_S = 20  # a phase is not started with less time than this left before the deadline


class PhaseError(Exception):
    """A phase that did not end ok: its status (failed / timeout), the error's last line, the numbers it had."""

    def __init__(self, status: str, error: str, numbers: dict):
        super().__init__(error)
        self.status, self.error, self.numbers = status, error, numbers


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str | None]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gpu_day", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_day.json and gpu_day.log (e.g. \"$OUT\")")
    ap.add_argument("--rehearse", action="store_true", help="every phase on CPU at tiny / ocr-mini shapes")
    ap.add_argument("--phases", default=None, help=f"comma-separated subset of: {','.join(PHASES)} (run in that order; "
                    "env is always run first)")
    ap.add_argument("--call", type=int, choices=sorted({p.call for p in PHASES.values()} - {0}), default=1,
                    help="without --phases on a GPU: the phases of this prepared device call (docs/offline_install.md)"
                         + "".join(f"; {k}: " + ",".join(n for n, p in PHASES.items() if p.call == k)
                                   for k in sorted({p.call for p in PHASES.values()} - {0})))
    ap.add_argument("--fail", default=None, metavar="PHASE", help="make this phase raise at its start (tests the guard)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the whole run's budget in seconds (default 540 on a GPU: the device call's 600 less the "
                         "install; 290 with --rehearse); each phase's cap is cut to what is left")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one phase in this process
    args = ap.parse_args(argv)
    if args.phases is None:  # on a GPU the phases of --call; the rehearsal runs the phases of every call
        names = [n for n, p in PHASES.items() if p.call == args.call or (args.rehearse and p.call)]
    else:
        names = [n.strip() for n in args.phases.split(",") if n.strip()]
    unknown = [n for n in names + ([args.fail] if args.fail else []) if n not in PHASES]
    if unknown:
        return args, f"unknown phase {unknown[0]!r}; choose from {', '.join(PHASES)}"
    if not names:
        return args, f"--phases names no phase; choose from {', '.join(PHASES)}"
    # the registry's order, whatever order they were given in; env in every call (the machine of each number)
    args.names = [n for n in PHASES if n in names or n == "env"]
    args.deadline_s = args.deadline_s or (290.0 if args.rehearse else 540.0)
    if args.deadline_s <= 0:
        return args, "--deadline-s must be > 0"
    return args, None


def main(argv: list[str] | None = None) -> int:
    args, error = parse_args(argv)
    if error:
        print(f"gpu_day: {error}", file=sys.stderr)
        return 2
    if args.child:
        return child_main(args)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".gpu_day_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        print(f"gpu_day: cannot write to --out {args.out} ({e.strerror}); choose a writable folder", file=sys.stderr)
        return 2
    return Day(args).run()


class Day:
    """The parent: runs the chosen phases one after another, each guarded, and keeps the JSON and log current."""

    def __init__(self, args):
        self.args = args
        self.json_path, self.log_path = args.out / "gpu_day.json", args.out / "gpu_day.log"
        self.t0 = time.monotonic()
        self.report = {"env": {"mode": "rehearse (CPU)" if args.rehearse else "gpu", "python": sys.version.split()[0],
                               "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                               "deadline_s": args.deadline_s},
                       "phases": {n: {"status": "pending"} for n in args.names}}
        if os.environ.get("GERL_INSTALL_S"):  # scripts/gpu_day.sh: seconds its bundle install took
            self.report["env"]["install_s"] = float(os.environ["GERL_INSTALL_S"])

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def write(self, after: str) -> None:
        """Rewrite gpu_day.json whole (a temp file renamed over it: a reader never sees half a file)."""
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(finite(self.report), indent=1) + "\n")
        os.replace(tmp, self.json_path)
        self.log(f"[gpu_day] gpu_day.json rewritten after {after}")

    def run(self) -> int:
        self.log(f"[gpu_day] {self.report['env']['mode']}: phases {', '.join(self.args.names)}; "
                 f"deadline {self.args.deadline_s:.0f} s")
        self.write("start")
        for name in self.args.names:
            self.report["phases"][name] = self.guarded(name)
            if name == "env" and self.report["phases"][name]["status"] == "ok":
                self.report["env"].update({k: v for k, v in self.report["phases"][name].items()
                                           if k not in ("status", "seconds")})
            r = self.report["phases"][name]
            self.log(f"[gpu_day] {name}: {r['status']} in {r.get('seconds', 0):.1f} s"
                     + (f" — {r['error']}" if r.get("error") else ""))
            self.write(name)
        self.report["env"]["total_s"] = time.monotonic() - self.t0
        self.report["env"]["gpu_processes_at_exit"] = gpu_processes()
        self.write("the last phase")
        bad = [n for n, r in self.report["phases"].items() if r["status"] in ("failed", "timeout")]
        self.log(f"[gpu_day] done in {self.report['env']['total_s']:.0f} s; "
                 + (f"not ok: {', '.join(bad)}" if bad else "no phase failed"))
        return 1 if bad else 0

    def guarded(self, name: str) -> dict:
        """One phase, whatever happens to it: its record (status, seconds, numbers, error)."""
        phase, t = PHASES[name], time.monotonic()
        missing = [m for m in phase.needs if not importable(m)]
        if missing:
            return {"status": "skipped", "seconds": 0.0, "error": f"needs {', '.join(missing)}, not installed"
                    + (f" ({phase.missing_hint})" if phase.missing_hint else "")}
        left = self.args.deadline_s - (time.monotonic() - self.t0)
        cap = min(phase.rehearse_cap_s if self.args.rehearse else phase.cap_s, left)
        if cap < MIN_CAP_S:
            return {"status": "skipped", "seconds": 0.0, "error": f"only {left:.0f} s left before the deadline"}
        try:
            numbers = self.run_child(name, cap)
            return {"status": "ok", "seconds": time.monotonic() - t, **numbers}
        except PhaseError as e:  # the guard: a failed or timed-out phase is recorded and the next one runs
            return {"status": e.status, "seconds": time.monotonic() - t, **e.numbers, "error": e.error}
        except Exception as e:  # noqa: BLE001 — the runner's own trouble with this phase (e.g. could not start it)
            return {"status": "failed", "seconds": time.monotonic() - t, "error": f"{type(e).__name__}: {e}"}

    def run_child(self, name: str, cap: float) -> dict:
        """Run phase `name` in a child process (its own process group) for at most `cap` seconds; its numbers, or
        PhaseError(failed | timeout) with whatever numbers it wrote before."""
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(a.out)]
        cmd += ["--rehearse"] if a.rehearse else []
        cmd += ["--fail", a.fail] if a.fail else []
        self.log(f"[gpu_day] {name}: start (cap {cap:.0f} s) — {PHASES[name].what}")
        with tempfile.TemporaryDirectory(prefix="gpu_day_") as tmp, open(self.log_path, "a") as log:
            result = Path(tmp) / "result.json"
            env = {**os.environ, RESULT_ENV: str(result), "PYTHONUNBUFFERED": "1",
                   "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
            code, stragglers = run_group(cmd, cap, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            got = json.loads(result.read_text()) if result.is_file() else {}
        numbers = got.get("numbers", {})
        if stragglers:
            numbers["stragglers_killed"] = stragglers
        if code is None:
            raise PhaseError("timeout", f"ran past its cap of {cap:.0f} s; its process group and every process it "
                                        f"started were killed", numbers)
        if code != 0 or got.get("status") != "ok":
            raise PhaseError("failed", got.get("error") or f"exit code {code} and no result (see gpu_day.log)",
                             numbers)
        return numbers


def child_main(args) -> int:
    """One phase in this process: its numbers (or the error's last line) to the parent's result file."""
    path = Path(os.environ[RESULT_ENV])
    numbers: dict = {}

    def save(status: str, error: str | None = None) -> None:
        path.write_text(json.dumps(finite({"status": status, "numbers": numbers, "error": error})))

    try:
        if args.fail == args.child:
            raise RuntimeError(f"--fail {args.child}: this phase fails on purpose")
        # the phase writes what it has measured so far through `partial`, so a timeout keeps those numbers
        run_phase(args.child, args.rehearse, args.out, numbers, partial=lambda: save("running"))
        save("ok")
        return 0
    except PhaseFailed as e:  # a check failed: the numbers stand, the phase is not ok
        save("failed", str(e))
        print(f"[gpu_day] {args.child}: check failed: {e}", flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 — any error of the phase; its traceback goes to gpu_day.log
        import traceback

        traceback.print_exc()
        save("failed", error_line(e))
        return 1


def error_line(e: BaseException) -> str:
    """The traceback's closing line, `Type: message`, with the message's first line (a multi-line message's last
    line is usually a hint, not what went wrong)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def finite(x):
    """NaN / inf → None, so the JSON is strict (NaN is not JSON) and a never-measured value reads as missing."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def gpu_processes() -> list[str] | None:
    """What holds a GPU now, as nvidia-smi lists it ("pid, name, MiB"); None without nvidia-smi (CPU)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else None


if __name__ == "__main__":
    sys.exit(main())
