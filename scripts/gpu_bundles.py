"""Wheels for a GPU machine that has no network and takes at most ~64 MiB per transfer (this workplace's lent H100 /
H200; docs/offline_install.md, "A GPU machine that already has CUDA torch"): what gerl needs there beyond the machine's own image, fetched
here for its Python, Ray slimmed, split into bundles that each fit one transfer beside the checkout.

    python scripts/gpu_bundles.py --out .whl                   # → .whl/bundle1, .whl/bundle2, ... (cp312, x86_64)
    python scripts/gpu_bundles.py --out .whl --python 3.11     # the same for another Python (a rehearsal here)

Then, on the GPU machine, every command begins with `. scripts/gpu_env.sh`: it installs whichever bundles the call
carried into .site/ of the checkout (kept between calls while the machine stays up) and puts gerl on PATH.

Why bundles: Ray's wheel alone is 79 MB, over the 64 MiB that one call carries, and the checkout takes 13 MB of it.
Ray's ray/jars (32 MB: the Java workers) and its dashboard web client (3 MB) are not used by a Python-only Ray with
include_dashboard=False, so they are dropped (slim_wheel), which brings Ray to ~44 MB. The rest — diffusers,
rapidocr (its two ONNX models are 27 MB) and a few small dependencies — is a second bundle.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# What the GPU machines' image holds (KINDS.md of the device tool, read 2026-11-17: torch 2.11+cu130 and ~190 more;
# only the names that gerl's dependency tree meets are listed). Requirements on these are taken as met.
IMAGE_HAS = {
    "accelerate", "aiohttp", "attrs", "certifi", "charset-normalizer", "click", "filelock", "fsspec", "grpcio",
    "huggingface-hub", "idna", "jinja2", "markupsafe", "matplotlib", "msgpack", "networkx", "numpy", "onnxruntime",
    "opencv-python-headless", "packaging", "peft", "pillow", "protobuf", "psutil", "pyyaml", "regex", "requests",
    "safetensors", "six", "sympy", "tensorboard", "tokenizers", "torch", "tqdm", "transformers", "typing-extensions",
    "urllib3", "zipp", "hf-xet", "pytest", "pytest-xdist",
}
# What gerl imports there that the image lacks: the core dependencies it misses, and Ray for the launchers.
ROOTS = ["diffusers", "rapidocr", "ray"]
# Files of a wheel that a Python-only, dashboard-less Ray never reads.
SLIM = {"ray": ("ray/jars/", "ray/dashboard/client/build/")}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
MB = 10**6


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path, python: str) -> list[str]:
    """The wheel's own requirements (no extras) whose environment markers hold on Linux x86_64 with `python`."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(req.name)
    return out


def closure(roots: list[str], have: set[str], fetch, python: str) -> list[Path]:
    """Every wheel needed for `roots` on a machine with `python` that already has `have`: `fetch(name) -> wheel
    path`, then that wheel's requirements, breadth first; names in `have` are taken as met."""
    seen = {canonical(n) for n in have}
    queue, wheels = list(roots), []
    while queue:
        name = canonical(queue.pop(0))
        if name in seen:
            continue
        seen.add(name)
        wheel = fetch(name)
        wheels.append(wheel)
        queue += requirements(wheel, python)
    return wheels


def slim_wheel(wheel: Path, drop: tuple[str, ...], out: Path) -> Path:
    """A copy of `wheel` in `out` without the files under `drop`, its RECORD rewritten to match (pip then installs
    it like any wheel)."""
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record or info.filename.startswith(drop):
                continue
            dst.writestr(info, src.read(info.filename))
        kept = [line for line in src.read(record).decode().splitlines() if not line.startswith(drop)]
        dst.writestr(record, "\n".join(kept) + "\n")
    return target


def pack(sizes: dict[str, int], cap: int) -> list[list[str]]:
    """First-fit decreasing: names grouped so that each group's total size is at most `cap` (one larger item alone)."""
    bins: list[tuple[int, list[str]]] = []
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        for i, (used, names) in enumerate(bins):
            if used + sizes[name] <= cap:
                bins[i] = (used + sizes[name], names + [name])
                break
        else:
            bins.append((sizes[name], [name]))
    return [names for _, names in bins]


class PipFetch:
    """pip download of one wheel (no dependencies) for the target Python on Linux x86_64."""

    def __init__(self, python: str, dest: Path):
        self.python, self.dest = python, dest

    def __call__(self, name: str) -> Path:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
               "cp", "--python-version", self.python, *(a for p in PLATFORMS for a in ("--platform", p)),
               "-d", str(self.dest), name]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"gpu_bundles: no wheel of {name} for Python {self.python} on Linux x86_64: "
                             f"{(r.stderr.strip().splitlines() or ['pip failed'])[-1]}")
        return next(p for p in self.dest.iterdir() if canonical(p.name.split("-")[0]) == canonical(name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True, help="folder for bundle1, bundle2, ... (e.g. .whl)")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12 on this workplace's image)")
    ap.add_argument("--cap-mb", type=int, default=50,
                    help="largest bundle in MB: the 64 MiB a call carries, less the checkout (~13 MB)")
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"gpu_bundles: {args.out} is not empty; remove it or choose another --out", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw, slim = Path(tmp) / "raw", Path(tmp) / "slim"
        raw.mkdir()
        slim.mkdir()
        final = {}
        for wheel in closure(ROOTS, IMAGE_HAS, PipFetch(args.python, raw), args.python):
            drop = SLIM.get(canonical(wheel.name.split("-")[0]))
            final[wheel.name] = slim_wheel(wheel, drop, slim) if drop else wheel
        sizes = {name: p.stat().st_size for name, p in final.items()}
        for i, names in enumerate(pack(sizes, args.cap_mb * MB), start=1):
            folder = args.out / f"bundle{i}"
            folder.mkdir()
            for name in names:
                (folder / name).write_bytes(final[name].read_bytes())
            print(f"{folder}: {sum(sizes[n] for n in names) / MB:.1f} MB: {', '.join(sorted(names))}")
    print(f"{len(sizes)} wheels for Python {args.python} on Linux x86_64: carry one bundle per device call "
          f"(carry: [\"{args.out}/bundleN\"]) and begin each command with `. scripts/gpu_env.sh`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
