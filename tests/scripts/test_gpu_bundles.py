"""scripts/gpu_bundles.py (wheels for the lent GPU machine, in bundles that fit one transfer each) and
scripts/gpu_env.sh (installs what a call carried): on synthetic wheels built here, installed for real by pip with
no index. Fetching from PyPI is replaced by a dict of those wheels (no network in the suite)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.scripts import REPO, load_script

gb = load_script("gpu_bundles")


def make_wheel(folder: Path, name: str, requires: list[str] = (), files: dict[str, bytes] | None = None) -> Path:
    """A minimal valid wheel `name-1.0-py3-none-any.whl` with a package `name` and the given Requires-Dist lines."""
    files = {f"{name}/__init__.py": b"VALUE = 1\n", **(files or {})}
    info = f"{name}-1.0.dist-info"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n".format(name) + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in files.items():
            z.writestr(p, data)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_requirements_keep_what_applies_to_linux_and_the_target_python(tmp_path):
    w = make_wheel(tmp_path, "pkg", ["alpha>=1", "beta; python_version < '3.12'", "gamma; sys_platform == 'win32'",
                                     "delta; extra == 'docs'", "Eps_Ilon; platform_machine == 'x86_64'"])
    assert gb.requirements(w, "3.12") == ["alpha", "Eps_Ilon"]
    assert gb.requirements(w, "3.11") == ["alpha", "beta", "Eps_Ilon"]


def test_closure_skips_what_the_image_has_and_fetches_the_rest_once(tmp_path):
    wheels = {"a": make_wheel(tmp_path, "a", ["b", "torch", "c"]), "b": make_wheel(tmp_path, "b", ["c", "Typing_Extensions"]),
              "c": make_wheel(tmp_path, "c", ["a"])}
    fetched = []

    def fetch(name):
        fetched.append(name)
        return wheels[name]

    got = gb.closure(["a"], {"torch", "typing-extensions"}, fetch, "3.12")
    assert fetched == ["a", "b", "c"] and got == [wheels["a"], wheels["b"], wheels["c"]]  # each once, none of the image's


def test_pins_are_read_and_every_fetch_asks_for_the_pinned_version(tmp_path, monkeypatch):
    pin_file = tmp_path / "pins.txt"
    pin_file.write_text("# comment\nDiffusers==0.42.1  # why\n\nrpds_py==2026.9.1\n")
    assert gb.pins(pin_file) == {"diffusers": "0.42.1", "rpds-py": "2026.9.1"}
    asked = []  # what pip would be asked to download (no network in the suite: the call is recorded and fails)
    monkeypatch.setattr(gb.subprocess, "run", lambda cmd, **kw: (
        asked.append(cmd[-1]), subprocess.CompletedProcess(cmd, 1, "", "no network here"))[1])
    fetch = gb.PipFetch("3.12", tmp_path, gb.pins(pin_file))
    with pytest.raises(SystemExit, match="no wheel of diffusers==0.42.1"):
        fetch("diffusers")
    assert asked == ["diffusers==0.42.1"]  # the pinned version, never the newest
    with pytest.raises(SystemExit, match="unknown-pkg is not pinned; add `unknown-pkg==VERSION` to scripts/pins.txt"):
        fetch("unknown-pkg")
    assert asked == ["diffusers==0.42.1"]  # nothing fetched for an unpinned name


def test_the_shipped_pins_cover_the_roots_and_are_what_this_venv_tests():
    """scripts/pins.txt is what setup.sh installs CI with (-c): the suite's own venv has those versions."""
    import importlib.metadata as md

    pinned = gb.pins()
    assert {"diffusers", "rapidocr", "ray"} <= set(pinned)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "-c scripts/pins.txt" in setup
    for name in ("diffusers", "rapidocr", "ray"):
        assert md.version(name) == pinned[name], name


def test_a_requirement_the_image_cannot_satisfy_is_named(tmp_path):
    w = make_wheel(tmp_path, "pkg", ["numpy<2.5", "torch>=2.4", "huggingface-hub<3,>=1.32", "other>=9"])
    assert gb.image_conflicts(w, "3.12") == ["pkg-1.0-py3-none-any.whl needs numpy<2.5, the image has 2.5.2"]


def test_stripping_rewrites_the_record_to_match(tmp_path):
    """An ELF file stripped inside a wheel: RECORD's hash and size are those of the new bytes (pip checks them)."""
    import base64
    import hashlib
    import shutil

    elf = Path(shutil.which("true")).read_bytes()
    w = make_wheel(tmp_path, "ray", files={"ray/core/raylet": elf, "ray/x.py": b"X = 1\n"})
    (tmp_path / "slim").mkdir()
    out = gb.slim_wheel(w, (), tmp_path / "slim", strip=True)
    with zipfile.ZipFile(out) as z:
        data = z.read("ray/core/raylet")
        record = {ln.split(",")[0]: ln for ln in z.read("ray-1.0.dist-info/RECORD").decode().splitlines()}
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert data[:4] == b"\x7fELF" and len(data) <= len(elf)
    assert record["ray/core/raylet"] == f"ray/core/raylet,sha256={digest},{len(data)}"
    assert record["ray/x.py"] == "ray/x.py,,"  # untouched files keep their line


def test_a_slimmed_wheel_installs_without_the_dropped_files(tmp_path):
    big = {"ray/jars/ray_dist.jar": b"x" * 1000, "ray/dashboard/client/build/index.html": b"<html/>",
           "ray/core.py": b"CORE = 2\n"}
    w = make_wheel(tmp_path, "ray", files=big)
    (tmp_path / "slim").mkdir()
    slim = gb.slim_wheel(w, gb.SLIM["ray"], tmp_path / "slim")
    with zipfile.ZipFile(slim) as z:
        names = z.namelist()
        record = z.read("ray-1.0.dist-info/RECORD").decode()
    assert "ray/core.py" in names and not any(n.startswith(("ray/jars/", "ray/dashboard/client/")) for n in names)
    assert "ray/core.py" in record and "jars" not in record and "dashboard" not in record
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                        str(slim)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (site / "ray" / "core.py").is_file() and not (site / "ray" / "jars").exists()


def test_gpu_env_installs_each_carried_wheel_once_and_puts_gerl_on_path(tmp_path):
    """The device-side script in a copy of the checkout's scripts/: a first call carries .whl/gpu, a second .whl/ray;
    each wheel is installed once, and `gerl --version` answers through the shim."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "gpu_env.sh").write_text((REPO / "scripts" / "gpu_env.sh").read_text())
    (root / ".whl" / "gpu").mkdir(parents=True)
    make_wheel(root / ".whl" / "gpu", "firstpkg")
    run = ["bash", "-c", f"cd {root} && . scripts/gpu_env.sh; echo rc=$?; python3 -c 'import firstpkg, secondpkg' "
                         f"2>&1 | tail -1; PYTHONPATH={REPO}:$PYTHONPATH gerl --version"]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    first = subprocess.run(run, capture_output=True, text=True, env=env)
    # this venv has torch, diffusers, ray and rapidocr, so the check passes and names their versions
    assert "rc=0" in first.stdout and "gpu_env: torch " in first.stdout, (first.stdout, first.stderr)
    assert "No module named 'secondpkg'" in first.stdout and "gerl" in first.stdout.splitlines()[-1]
    (root / ".whl" / "ray").mkdir()
    make_wheel(root / ".whl" / "ray", "secondpkg")
    stamp = (root / ".site" / ".installed" / "firstpkg-1.0-py3-none-any.whl").stat().st_mtime_ns
    second = subprocess.run(run, capture_output=True, text=True, env=env)
    assert "No module named" not in second.stdout, second.stdout  # both bundles installed now
    assert (root / ".site" / ".installed" / "firstpkg-1.0-py3-none-any.whl").stat().st_mtime_ns == stamp  # not redone


def test_a_folder_that_is_not_empty_is_refused(tmp_path, capsys):
    (tmp_path / "x").write_text("")
    assert gb.main(["--out", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_the_bundles_and_the_installs_stay_out_of_git():
    ignored = (REPO / ".gitignore").read_text().split()
    assert ".whl/" in ignored and ".site/" in ignored
