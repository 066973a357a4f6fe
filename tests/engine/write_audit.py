"""`gerl train` under an audit of its writes: every file this process opens for writing, and every directory it makes,
renames or removes, under the run directory (`output_dir=` among the arguments), is recorded through Python's audit
hooks (sys.addaudithook) and written to $GERL_WRITE_AUDIT/rank<RANK>.json when the process exits. Run by
tests/engine/test_launcher.py as torchrun's script, so each rank reports what it wrote."""

import atexit
import json
import os
import sys
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate")


def main() -> int:
    argv = sys.argv[1:]
    run_dir = os.path.realpath(next(a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")))
    written: list[str] = []

    def inside(path) -> bool:
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(run_dir)
        except (TypeError, ValueError):
            return False  # a file descriptor: opened earlier, by path

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
            if writes and inside(path):
                written.append(f"open {os.fsdecode(path)}")
        elif event in PATH_EVENTS and args and inside(args[0]):
            written.append(f"{event} {os.fsdecode(args[0])}")

    out = Path(os.environ["GERL_WRITE_AUDIT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    atexit.register(lambda: out.write_text(json.dumps(sorted(set(written)))))
    sys.addaudithook(hook)
    from gerl.cli import main as gerl

    return gerl(argv)


if __name__ == "__main__":
    sys.exit(main())
