"""scripts/gpu_bundles.py (wheels for the lent GPU machine, in bundles that fit one transfer each) and
scripts/gpu_env.sh (installs what a call carried): on synthetic wheels built here, installed for real by pip with
no index. Fetching from PyPI is replaced by a dict of those wheels (no network in the suite)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_pack_is_first_fit_decreasing_under_the_cap():
    sizes = {"ray": 44, "rapidocr": 27, "diffusers": 6, "shapely": 3, "small": 1, "huge": 70}
    bundles = gb.pack(sizes, 50)
    # hand-worked: huge alone (over the cap), ray + diffusers (50), rapidocr + shapely + small (31)
    assert bundles == [["huge"], ["ray", "diffusers"], ["rapidocr", "shapely", "small"]]
    assert all(sum(sizes[n] for n in b) <= 50 for b in bundles[1:])
    assert sorted(n for b in bundles for n in b) == sorted(sizes)


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
    """The device-side script in a copy of the checkout's scripts/: a first call carries bundle1, a second bundle2;
    each wheel is installed once, and `gerl --version` answers through the shim."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "gpu_env.sh").write_text((REPO / "scripts" / "gpu_env.sh").read_text())
    (root / ".whl" / "bundle1").mkdir(parents=True)
    make_wheel(root / ".whl" / "bundle1", "firstpkg")
    run = ["bash", "-c", f"cd {root} && . scripts/gpu_env.sh; echo rc=$?; python3 -c 'import firstpkg, secondpkg' "
                         f"2>&1 | tail -1; PYTHONPATH={REPO}:$PYTHONPATH gerl --version"]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    first = subprocess.run(run, capture_output=True, text=True, env=env)
    # this venv has torch, diffusers, ray and rapidocr, so the check passes and names their versions
    assert "rc=0" in first.stdout and "gpu_env: torch " in first.stdout, (first.stdout, first.stderr)
    assert "No module named 'secondpkg'" in first.stdout and "gerl" in first.stdout.splitlines()[-1]
    (root / ".whl" / "bundle2").mkdir()
    make_wheel(root / ".whl" / "bundle2", "secondpkg")
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
