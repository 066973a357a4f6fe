"""Wheels for a GPU machine that has no network and takes at most ~64 MiB per transfer (this workplace's lent H100 /
H200; docs/offline_install.md, "A GPU machine that already has CUDA torch"): what gerl needs there beyond the
machine's own image, fetched here for its Python at exactly the versions CI tests (scripts/pins.txt, which
scripts/setup.sh installs CI with), in two bundles that each fit one transfer beside the checkout.

    python scripts/gpu_bundles.py --out .whl                   # → .whl/gpu and .whl/ray (cp312, x86_64)
    python scripts/gpu_bundles.py --out .whl --python 3.11     # the same for another Python (a rehearsal here)

`.whl/gpu` (diffusers, rapidocr and what they need beyond the image) is what `bash scripts/gpu_day.sh` needs for
every phase but the launcher; `.whl/ray` (Ray, for the launcher) follows in a second call while the machine is
warm. On the GPU machine `. scripts/gpu_env.sh` installs whichever bundles a call carried into .site/ of the
checkout (kept between calls while the machine stays up) and puts gerl on PATH.

Why two: Ray's wheel alone is 79 MB, over the 64 MiB that one call carries, and the checkout takes 13 MB of it.
Ray's ray/jars (32 MB: the Java workers) and its dashboard web client (3 MB) are not used by a Python-only Ray with
include_dashboard=False, so they are dropped, and its native binaries are stripped of their symbol tables
(`strip --strip-unneeded`: 119 → 84 MB unpacked), which brings Ray to ~40 MB. Every wheel's requirements on the
image's own packages are checked against the image's versions (IMAGE), so a pin the image cannot satisfy stops
here, not on the GPU.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# What the GPU machines' image holds (KINDS.md of the device tool, read 2026-11-17: torch 2.11+cu130 and ~190 more;
# only the names that gerl's dependency tree meets are listed). Requirements on these are taken as met, and checked
# against IMAGE's versions where KINDS.md gives one.
IMAGE_HAS = {
    "accelerate", "aiohttp", "attrs", "certifi", "charset-normalizer", "click", "filelock", "fsspec", "grpcio",
    "huggingface-hub", "idna", "jinja2", "markupsafe", "matplotlib", "msgpack", "networkx", "numpy", "onnxruntime",
    "opencv-python-headless", "packaging", "peft", "pillow", "protobuf", "psutil", "pyyaml", "regex", "requests",
    "safetensors", "six", "sympy", "tensorboard", "tokenizers", "torch", "tqdm", "transformers", "typing-extensions",
    "urllib3", "zipp", "hf-xet", "pytest", "pytest-xdist",
}
IMAGE = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.5.2", "onnxruntime": "1.30.0", "accelerate": "1.15.0",
         "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "protobuf": None}
# What gerl imports there that the image lacks, per bundle: gpu_day's phases need the first, its launcher phase both.
BUNDLES = {"gpu": ["diffusers", "rapidocr"], "ray": ["ray"]}
# Files of a wheel that a Python-only, dashboard-less Ray never reads; wheels whose ELF files are stripped.
SLIM = {"ray": ("ray/jars/", "ray/dashboard/client/build/")}
STRIP = {"ray"}
PINS_FILE = Path(__file__).resolve().parent / "pins.txt"
CHECKOUT_CAP_MIB = 60  # the bundle of one call plus the checkout (the call carries 64 MiB; leave a margin)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = PINS_FILE) -> dict[str, str]:
    """{canonical name: version} from a pip constraints file of `name==version` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version.strip()
    return out


def requirements(wheel: Path, python: str, specs: bool = False) -> list:
    """The wheel's own requirements (no extras) whose environment markers hold on Linux x86_64 with `python`:
    their names, or (with `specs`) the packaging Requirement objects."""
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
                out.append(req if specs else req.name)
    return out


def image_conflicts(wheel: Path, python: str, image: dict[str, str | None] = IMAGE) -> list[str]:
    """The wheel's requirements on the image's packages that the image's versions do not satisfy."""
    from packaging.version import Version

    bad = []
    for req in requirements(wheel, python, specs=True):
        have = image.get(canonical(req.name))
        if have is not None and req.specifier and Version(have) not in req.specifier:
            bad.append(f"{wheel.name} needs {req.name}{req.specifier}, the image has {have}")
    return bad


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


def slim_wheel(wheel: Path, drop: tuple[str, ...], out: Path, strip: bool = False) -> Path:
    """A copy of `wheel` in `out` without the files under `drop` and, with `strip`, its ELF files stripped of the
    symbols nothing links against (`strip --strip-unneeded`); its RECORD rewritten to match (hash and size of each
    changed file), so pip installs it like any wheel."""
    target = out / wheel.name
    changed: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record or info.filename.startswith(drop):
                continue
            data = src.read(info.filename)
            if strip and data[:4] == b"\x7fELF":
                data = stripped(data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                changed[info.filename] = f"{info.filename},sha256={digest},{len(data)}"
            dst.writestr(info, data)
        kept = [changed.get(line.split(",")[0], line) for line in src.read(record).decode().splitlines()
                if not line.startswith(drop)]
        dst.writestr(record, "\n".join(kept) + "\n")
    return target


def stripped(data: bytes) -> bytes:
    """An ELF file's bytes after `strip --strip-unneeded` (binutils); unchanged if strip refuses it."""
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "elf"
        f.write_bytes(data)
        r = subprocess.run(["strip", "--strip-unneeded", str(f)], capture_output=True)
        return f.read_bytes() if r.returncode == 0 else data


class PipFetch:
    """pip download of one wheel (no dependencies), at its pinned version, for the target Python on Linux x86_64."""

    def __init__(self, python: str, dest: Path, pinned: dict[str, str] | None = None):
        self.python, self.dest, self.pinned = python, dest, pinned if pinned is not None else pins()

    def __call__(self, name: str) -> Path:
        if canonical(name) not in self.pinned:
            raise SystemExit(f"gpu_bundles: {name} is not pinned; add `{name}==VERSION` to scripts/pins.txt with the "
                             f"version CI installs (`pip show {name}` in its venv), so the bundle carries what CI tests")
        spec = f"{name}=={self.pinned[canonical(name)]}"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
               "cp", "--python-version", self.python, *(a for p in PLATFORMS for a in ("--platform", p)),
               "-d", str(self.dest), spec]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"gpu_bundles: no wheel of {spec} for Python {self.python} on Linux x86_64: "
                             f"{(r.stderr.strip().splitlines() or ['pip failed'])[-1]}")
        return next(p for p in self.dest.iterdir() if canonical(p.name.split("-")[0]) == canonical(name))


def checkout_mib(root: Path = Path(__file__).resolve().parents[1]) -> float | None:
    """MiB of the files git tracks in this checkout (what a device call carries besides the bundle)."""
    r = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True)
    if r.returncode != 0:
        return None
    return sum((root / f).stat().st_size for f in r.stdout.decode().split("\0") if f and (root / f).is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True, help="folder for the bundles gpu/ and ray/ (e.g. .whl)")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12 on this workplace's image)")
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"gpu_bundles: {args.out} is not empty; remove it or choose another --out", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    checkout = checkout_mib()
    over = []
    with tempfile.TemporaryDirectory() as tmp:
        raw, slim = Path(tmp) / "raw", Path(tmp) / "slim"
        raw.mkdir()
        slim.mkdir()
        fetch, have = PipFetch(args.python, raw), set(IMAGE_HAS)
        for bundle, roots in BUNDLES.items():
            folder = args.out / bundle
            folder.mkdir()
            wheels = closure(roots, have, fetch, args.python)
            have |= {canonical(w.name.split("-")[0]) for w in wheels}  # a later bundle reuses an earlier one's
            conflicts = [c for w in wheels for c in image_conflicts(w, args.python)]
            if conflicts:
                print(f"gpu_bundles: {conflicts[0]}; pin a version the image satisfies in scripts/pins.txt",
                      file=sys.stderr)
                return 1
            for w in wheels:
                name = canonical(w.name.split("-")[0])
                final = (slim_wheel(w, SLIM.get(name, ()), slim, strip=name in STRIP)
                         if name in SLIM or name in STRIP else w)
                (folder / w.name).write_bytes(final.read_bytes())
            mib = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
            total = f"; with the checkout's {checkout:.1f} MiB: {mib + checkout:.1f} MiB" if checkout else ""
            print(f"{folder}: {mib:.1f} MiB{total}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
            if checkout and mib + checkout > CHECKOUT_CAP_MIB:
                over.append(f"{folder} + the checkout = {mib + checkout:.1f} MiB > {CHECKOUT_CAP_MIB} MiB")
    if over:
        print(f"gpu_bundles: {over[0]}: it will not travel in one call", file=sys.stderr)
        return 1
    print(f"bundles for Python {args.python} on Linux x86_64 at scripts/pins.txt's versions: carry [\"{args.out}/gpu\"] "
          f"with `bash scripts/gpu_day.sh \"$OUT\"`, then [\"{args.out}/ray\"] for the launcher (docs/offline_install.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
