"""`python -m benchmarks`: one entry point that lists every benchmark and runs one by name."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_lists_every_benchmark_file_with_its_summary():
    r = _run()
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")}
    on_disk = {p.stem.removeprefix("bench_") for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert listed == on_disk and {"sampler", "async", "gpu", "stream", "reproduce_tables"} <= listed
    assert not list((REPO / "scripts").glob("bench_*.py")), "benchmarks live in benchmarks/ only"


def test_runs_one_by_name_and_names_a_mistyped_one():
    r = _run("stream", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m benchmarks stream"), r.stdout + r.stderr
    r = _run("strem")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "python -m benchmarks: no benchmark 'strem'; did you mean 'stream'? `python -m benchmarks` lists them all"]
