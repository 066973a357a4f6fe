"""scripts/vllm_check.sh in the suite: vLLM's CPU build serving the VLM reward, for real.

`pytest -m vllm` runs the whole check where its venv is built (`bash scripts/vllm_check.sh` builds .venv-vllm once:
~3 min and 3.5 GB; GERL_VLLM_VENV names another); without it that test is skipped, so CI (which does not build it:
docs/rewards_vlm.md says why) skips it. The readiness poll's failure path runs everywhere: a launcher whose python has
no vLLM exits at once, and the check must stop with the launcher's own message, not wait for its deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("GERL_VLLM_VENV", REPO / ".venv-vllm"))
sys.path.insert(0, str(REPO / "scripts"))
import vllm_check  # noqa: E402


def test_server_that_exits_early_fails_the_readiness_poll_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(vllm_check.CheckFailed) as err:  # gerl's python has no vLLM: the launcher exits 2
        vllm_check.Server(sys.executable, tmp_path / "no_model", tmp_path / "serve.log", startup_timeout_s=120)
    assert time.monotonic() - t0 < 30, "the poll waited for its deadline instead of noticing the exit"
    assert "exited with code 2 before it was ready" in str(err.value)
    assert "pip install 'gerl[vllm]'" in str(err.value)  # the launcher's own line, from the log's tail


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not (VENV / ".gerl-vllm-ready").is_file(),
                    reason=f"no vLLM venv at {VENV}: `bash scripts/vllm_check.sh` builds it (~3 min, 3.5 GB)")
def test_vllm_check_script():
    env = {**os.environ, "GERL_PYTHON": sys.executable, "GERL_VLLM_VENV": str(VENV)}
    run = subprocess.run(["bash", str(REPO / "scripts" / "vllm_check.sh")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_check OK: vlm_ocr over HTTP 32/32 scored"), last
    assert "req/s" in last and "32/32 replies as over HTTP" in last and "timed out and counted" in last
