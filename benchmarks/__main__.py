"""List the benchmarks, or run one: `python -m benchmarks` / `python -m benchmarks NAME [args...]`.

NAME is a file name in benchmarks/ without `bench_` and `.py` (`sampler` runs bench_sampler.py), or the name of a
file that has no `bench_` prefix (`reproduce_tables`). Each benchmark also runs as `python benchmarks/FILE.py`.
Results and their commands: docs/benchmarks.md.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROG = "python -m benchmarks"
# NAME -> (file stem, arguments put before the user's): bench_gpu_launchers.py has no main of its own, it is the
# `--launchers` part of bench_gpu.py.
ALIASES = {"gpu_launchers": ("bench_gpu", ["--launchers"])}


def benchmarks() -> dict[str, Path]:
    """NAME -> file, in name order: bench_*.py, then the other scripts here (not this package's own files)."""
    files = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))
    return {p.stem.removeprefix("bench_"): p for p in files}


def summary(path: Path, width: int = 100) -> str:
    """The first sentence of the file's docstring (read without importing it), cut to `width` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    for end in (". ", ": "):
        if end in para:
            para = para[: para.index(end)]
    para = para.rstrip(".:")
    return para if len(para) <= width else para[: width - 1].rsplit(" ", 1)[0] + " …"


def usage() -> str:
    found = benchmarks()
    pad = max(map(len, found))
    lines = [f"usage: {PROG} NAME [args...]   ({PROG} NAME --help for a benchmark's options)", "", "benchmarks:"]
    lines += [f"  {name:<{pad}}  {summary(path)}" for name, path in found.items()]
    return "\n".join(lines)


def load(path: Path):
    """The file as a module (by path: benchmarks/ holds no importable names like `async`)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # as the import system would (dataclasses look their module up here)
    spec.loader.exec_module(module)
    return module


def run(name: str, args: list[str]) -> int:
    found = benchmarks()
    stem, before = ALIASES.get(name, (None, []))
    path = HERE / f"{stem}.py" if stem else found[name]
    module = load(path)
    argv = before + args
    # argparse names the program after sys.argv[0]: the benchmarks' --help then shows how to call them
    sys.argv = [f"{PROG} {path.stem.removeprefix('bench_')}", *argv]
    main = module.main
    result = main(argv) if inspect.signature(main).parameters else main()
    return result if isinstance(result, int) else 0  # main() returns an exit status or None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, args = argv[0], argv[1:]
    known = list(benchmarks())
    if name not in known:
        close = difflib.get_close_matches(name.removeprefix("bench_").removesuffix(".py"), known, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"{PROG}: no benchmark {name!r}; {hint}`{PROG}` lists them all", file=sys.stderr)
        return 2
    return run(name, args)


if __name__ == "__main__":
    sys.exit(main())
