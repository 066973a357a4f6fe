"""Tests of the benchmarks/ and scripts/ entry points, loaded as modules and called through their own main(argv)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOMES = (REPO / "benchmarks", REPO / "scripts")  # benchmarks (bench_*, reproduce_tables, ...), then the rest


def load_script(name: str):
    """NAME.py from benchmarks/ or else scripts/, as a module (loaded by path, as the scripts run as files)."""
    path = next((home / f"{name}.py" for home in HOMES if (home / f"{name}.py").is_file()), HOMES[-1] / f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
