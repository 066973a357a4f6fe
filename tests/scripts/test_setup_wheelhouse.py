"""scripts/setup.sh --wheelhouse DIR / GERL_WHEELHOUSE=DIR: installs from a folder of wheels with no index.

The real script runs as a subprocess, copied into a temporary tree so that nothing can touch the project's
.venv; PYTHON=false makes any venv step fail at once (exit 1, not 2) should argument checking ever come after it.
The offline install itself is real: the pip options the script prints install a wheel built here, with no index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup_sh(tmp_path) -> Path:
    """A copy of scripts/setup.sh inside an empty project tree."""
    (tmp_path / "proj" / "scripts").mkdir(parents=True)
    script = tmp_path / "proj" / "scripts" / "setup.sh"
    shutil.copy(REPO / "scripts" / "setup.sh", script)
    return script


def run(script: Path, *args: str, cwd: Path, wheelhouse_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GERL_WHEELHOUSE"}
    env["PYTHON"] = "false"  # a venv step would fail at once with exit 1
    if wheelhouse_env is not None:
        env["GERL_WHEELHOUSE"] = wheelhouse_env
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def assert_usage_error(proc: subprocess.CompletedProcess, *words: str, project: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert not (project / ".venv").exists()


def test_missing_wheelhouse_is_a_one_line_error_naming_path_and_fix(setup_sh, tmp_path):
    missing = tmp_path / "no-such-dir"
    proc = run(setup_sh, "--wheelhouse", str(missing), cwd=tmp_path)
    assert_usage_error(proc, str(missing), "docs/offline_install.md", "GERL_WHEELHOUSE", project=setup_sh.parents[1])


def test_wheelhouse_from_the_environment_is_checked_too(setup_sh, tmp_path):
    a_file = tmp_path / "wheels.txt"
    a_file.write_text("not a directory")
    proc = run(setup_sh, cwd=tmp_path, wheelhouse_env=str(a_file))
    assert_usage_error(proc, str(a_file), "not a directory", project=setup_sh.parents[1])


@pytest.mark.parametrize("args", [["--bogus"], ["--wheelhouse"], ["install"]])
def test_bad_arguments_are_a_one_line_error(setup_sh, tmp_path, args):
    proc = run(setup_sh, *args, cwd=tmp_path)
    assert_usage_error(proc, "--wheelhouse", project=setup_sh.parents[1])


def test_pip_args_default_to_none_and_resolve_a_relative_wheelhouse_from_the_callers_directory(setup_sh, tmp_path):
    (tmp_path / "wh").mkdir()
    assert run(setup_sh, "--print-pip-args", cwd=tmp_path).stdout == ""  # no wheelhouse: PyPI, as before
    expected = f"--no-index\n--find-links\n{tmp_path / 'wh'}\n"
    assert run(setup_sh, "--wheelhouse", "wh", "--print-pip-args", cwd=tmp_path).stdout == expected
    assert run(setup_sh, "--wheelhouse=wh", "--print-pip-args", cwd=tmp_path).stdout == expected
    assert run(setup_sh, "--print-pip-args", cwd=tmp_path, wheelhouse_env="wh").stdout == expected


def build_wheel(wheelhouse: Path, name: str, version: str = "0.1") -> None:
    """A minimal pure-Python wheel (one module setting VALUE = 42), written by hand: no build backend needed."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(wheelhouse / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


def test_the_printed_pip_args_install_offline_from_the_wheelhouse(setup_sh, tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    build_wheel(wheelhouse, "gerl_offline_probe")
    pip_args = run(setup_sh, "--wheelhouse", str(wheelhouse), "--print-pip-args", cwd=tmp_path).stdout.split()
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": os.devnull}
    install = [sys.executable, "-m", "pip", "install", "-q", *pip_args, "--target"]

    target = tmp_path / "site"
    proc = subprocess.run([*install, str(target), "gerl_offline_probe"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    probe = subprocess.run([sys.executable, "-c", "import gerl_offline_probe as m; print(m.VALUE)"],
                           env={**env, "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "42", probe.stderr

    # no index is consulted: a package that is not in the wheelhouse cannot be found
    proc = subprocess.run([*install, str(tmp_path / "site2"), "gerl_not_in_wheelhouse"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "No matching distribution" in proc.stderr, proc.stderr
