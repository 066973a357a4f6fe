"""vLLM serving gerl's `vlm_ocr` reward, for real, on CPU: the driver behind scripts/vllm_check.sh.

    python scripts/vllm_check.py --vllm-python .venv-vllm/bin/python      # gerl's python runs this

Phases (each prints one line; any failure stops with `vllm_check FAILED: ...` and exit 1):
1. build a tiny random LLaVA (head_dim 64) with the vLLM venv's transformers (tests/rewards/tiny_llava.py);
2. serve it through scripts/serve_vlm_reward.sh (the launcher a GPU user runs) and poll /health and /v1/models until
   the model is listed, with a deadline; an early exit or the deadline stops with the server log's tail;
3. score rendered text images through `vlm_ocr` over HTTP with 1 and 8 requests in flight (requests/s each);
4. timeouts: a server that accepts connections and never answers; every request fails by its timeout, counted;
5. the server killed (SIGKILL) mid-run: the requests after it fail fast and are counted, none hangs;
6. `backend: vllm_inprocess` in the vLLM venv (this script with --inprocess) on the same images and model.
The last line sums it up: scores, requests/s, failures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

N_IMAGES = 32
MAX_TOKENS = 8
ENGINE_KWARGS = {"max_model_len": 512, "dtype": "bfloat16", "max_num_seqs": 16}  # the tiny model knows 512 positions


class CheckFailed(Exception):
    pass


def images_and_prompts(n: int = N_IMAGES):
    """Rendered text ("GERL 0" ... on white), 64 px, and prompts quoting it: what an OCR reward sees."""
    from PIL import Image, ImageDraw

    images, prompts = [], []
    for i in range(n):
        image = Image.new("RGB", (64, 64), "white")
        ImageDraw.Draw(image).text((4, 24), f"GERL {i}", fill="black")
        images.append(image)
        prompts.append(f'a poster with the words "GERL {i}"')
    return images, prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """scripts/serve_vlm_reward.sh in its own process group, its output in `log`."""

    def __init__(self, vllm_python: str, model_dir: Path, log: Path, startup_timeout_s: float):
        self.port = free_port()
        self.model = str(model_dir)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        env = {**os.environ, "VLLM_PYTHON": vllm_python, "HOST": "127.0.0.1", "PORT": str(self.port),
               "MAX_LEN": str(ENGINE_KWARGS["max_model_len"]), "MAX_SEQS": "16", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        env.pop("GERL_VLM_API_KEY", None)
        self._out = open(log, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(["bash", str(REPO / "scripts" / "serve_vlm_reward.sh"), "ocr", self.model],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.startup_s = self._wait_ready(startup_timeout_s, t0)

    def _wait_ready(self, timeout_s: float, t0: float) -> float:
        """Poll GET /health, then GET /v1/models until the model is listed; seconds it took."""
        deadline = t0 + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise CheckFailed(f"the server exited with code {self.proc.returncode} before it was ready; "
                                  f"log {self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as m:
                            if self.model in {d["id"] for d in json.loads(m.read())["data"]}:
                                return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise CheckFailed(f"the server was not ready after {timeout_s:.0f} s (raise VLLM_STARTUP_TIMEOUT_S "
                                  f"on a slow machine); log {self.log}:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL to the whole group (bash exec'd into python; vLLM's engine core is a child process)."""
        try:  # even when the launcher itself has exited: its engine-core child may still be in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._out.close()


def score(reward, images, prompts):
    from rewards.registry import call_reward

    t0 = time.monotonic()
    scores, extras = call_reward(reward, images, prompts, [{}] * len(images))
    return scores, extras, time.monotonic() - t0


def check_scores(scores, extras, prompts, what: str) -> None:
    """Every request answered, and each score is the OCR score of its reply against its target."""
    from rewards.ocr import ocr_score, target_for

    if any(extras["vlm_failed"]):
        raise CheckFailed(f"{what}: {sum(extras['vlm_failed'])} of {len(prompts)} requests failed")
    for s, text, p in zip(scores, extras["vlm_text"], prompts):
        if s != ocr_score(text, target_for(p, {})):
            raise CheckFailed(f"{what}: score {s} is not ocr_score({text!r}, {target_for(p, {})!r})")


def http_phases(server: Server) -> dict:
    from rewards import vlm  # noqa: F401  (registers vlm_ocr)
    from rewards.registry import build_reward

    images, prompts = images_and_prompts()
    out: dict = {"startup_s": round(server.startup_s, 1)}
    texts = None
    for inflight in (1, 8):
        reward = build_reward("vlm_ocr", {"base_url": server.base_url, "model": server.model,
                                          "max_concurrency": inflight, "max_tokens": MAX_TOKENS})
        reward.validate(prompts, [{}] * len(prompts))  # GET /v1/models: up and serving this model
        scores, extras, dt = score(reward, images, prompts)
        check_scores(scores, extras, prompts, f"HTTP, {inflight} in flight")
        out[f"rps_{inflight}"] = round(len(images) / dt, 1)
        if texts is not None and extras["vlm_text"] != texts:
            diff = sum(a != b for a, b in zip(texts, extras["vlm_text"]))
            raise CheckFailed(f"greedy replies changed with concurrency: {diff} of {len(texts)} differ")
        texts = extras["vlm_text"]
        print(f"vllm_check: HTTP {len(images)} images, {inflight} in flight: {out[f'rps_{inflight}']} requests/s, "
              f"mean score {sum(scores) / len(scores):.3f}", flush=True)
    out["scores"], out["texts"] = scores, texts
    return out


def timeout_phase() -> dict:
    """A listener that accepts (the kernel completes the handshake) and never answers: each attempt times out."""
    from rewards.registry import build_reward

    images, prompts = images_and_prompts(4)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        reward = build_reward("vlm_ocr", {"base_url": url, "model": "m", "timeout_s": 1.0, "max_retries": 1,
                                          "max_concurrency": 4})
        reward.client.backoff_s = 0.1
        scores, extras, dt = score(reward, images, prompts)
    if scores != [None] * 4 or extras["vlm_failed"] != [1] * 4:
        raise CheckFailed(f"silent server: expected 4 counted failures, got scores {scores}, {extras['vlm_failed']}")
    if dt > 10:  # 2 attempts x 1 s + 0.1 s backoff, 4 at once
        raise CheckFailed(f"silent server: the timed-out requests took {dt:.1f} s (bound 10 s)")
    print(f"vllm_check: a server that never answers: 4/4 requests failed by their 1 s timeout (2 attempts) in "
          f"{dt:.1f} s, counted in vlm_failed", flush=True)
    return {"timeout_failed": 4, "timeout_s_total": round(dt, 1)}


def kill_phase(server: Server) -> dict:
    """40 requests, 2 in flight; SIGKILL the server after the first reply: the rest fail fast, counted, no hang."""
    from rewards.registry import build_reward

    n = 40
    images, prompts = images_and_prompts(n)
    reward = build_reward("vlm_ocr", {"base_url": server.base_url, "model": server.model, "max_concurrency": 2,
                                      "max_retries": 1, "timeout_s": 60.0, "max_tokens": MAX_TOKENS})
    reward.client.backoff_s = 0.1
    answered = threading.Event()
    chat = reward.client.chat

    def chat_and_tell(*args, **kwargs):
        reply = chat(*args, **kwargs)
        if reply.text is not None:
            answered.set()
        return reply

    reward.client.chat = chat_and_tell
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=score(reward, images, prompts)), daemon=True)
    worker.start()
    if not answered.wait(120):
        raise CheckFailed("no reply within 120 s before the kill")
    server.kill()
    t_kill = time.monotonic()
    worker.join(120)
    if worker.is_alive():
        raise CheckFailed("the reward call hung after the server was killed")
    after = time.monotonic() - t_kill
    scores, extras, _ = result["r"]
    failed = sum(extras["vlm_failed"])
    if not 1 <= failed < n or after > 30:
        raise CheckFailed(f"server killed mid-run: {failed}/{n} failed, {after:.1f} s after the kill "
                          f"(expected some before and some after, within 30 s)")
    if any((s is None) != bool(f) for s, f in zip(scores, extras["vlm_failed"])):
        raise CheckFailed("a failed request got a score, or an answered one none")
    print(f"vllm_check: server SIGKILLed mid-run: {n - failed}/{n} scored before, {failed}/{n} failed and counted, "
          f"the call returned {after:.1f} s after the kill", flush=True)
    return {"killed_failed": failed, "killed_n": n, "after_kill_s": round(after, 1)}


def inprocess(model_dir: str, out: str) -> None:
    """Child mode (the vLLM venv's python): score the same images with backend vllm_inprocess; JSON to `out`."""
    from rewards import vlm  # noqa: F401
    from rewards.registry import build_reward

    images, prompts = images_and_prompts()
    reward = build_reward("vlm_ocr", {"backend": "vllm_inprocess", "model": model_dir, "max_tokens": MAX_TOKENS,
                                      "engine_kwargs": ENGINE_KWARGS})
    t0 = time.monotonic()
    first = score(reward, images[:1], prompts[:1])  # loads the engine
    load_s = time.monotonic() - t0
    scores, extras, dt = score(reward, images, prompts)
    check_scores(scores, extras, prompts, "vllm_inprocess")
    Path(out).write_text(json.dumps({"load_s": round(load_s, 1), "rps": round(len(images) / dt, 1),
                                     "scores": scores, "texts": extras["vlm_text"], "first": first[0]}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--vllm-python", help="python of the venv holding vllm-cpu (scripts/vllm_check.sh builds it)")
    p.add_argument("--inprocess", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inprocess:
        inprocess(args.inprocess, args.out)
        return 0
    if not args.vllm_python:
        p.error("--vllm-python is required")
    work = Path(tempfile.mkdtemp(prefix="gerl_vllm_check_"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    server = None
    try:
        t0 = time.monotonic()
        subprocess.run([args.vllm_python, "-m", "tests.rewards.tiny_llava", str(work / "tiny_llava"), "64"],
                       cwd=REPO, env=env, check=True, capture_output=True)
        print(f"vllm_check: tiny random LLaVA (head_dim 64) built offline in {time.monotonic() - t0:.0f} s",
              flush=True)
        server = Server(args.vllm_python, work / "tiny_llava", work / "serve.log",
                        float(os.environ.get("VLLM_STARTUP_TIMEOUT_S", "600")))
        print(f"vllm_check: scripts/serve_vlm_reward.sh ready in {server.startup_s:.0f} s at {server.base_url}",
              flush=True)
        http = http_phases(server)
        timeouts = timeout_phase()
        killed = kill_phase(server)
        t0 = time.monotonic()
        child = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--inprocess",
                                str(work / "tiny_llava"), "--out", str(work / "inprocess.json")],
                               cwd=REPO, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True)
        if child.returncode != 0:
            raise CheckFailed(f"backend vllm_inprocess exited with {child.returncode}:\n{child.stderr[-3000:]}")
        inproc = json.loads((work / "inprocess.json").read_text())
        same = sum(a == b for a, b in zip(inproc["texts"], http["texts"]))
        if same != N_IMAGES:  # the same weights, greedy: the engine in this process must read as the server did
            raise CheckFailed(f"vllm_inprocess replied differently from the server on {N_IMAGES - same} of "
                              f"{N_IMAGES} images, e.g. {inproc['texts'][0]!r} vs {http['texts'][0]!r}")
        print(f"vllm_check: backend vllm_inprocess: engine loaded in {inproc['load_s']} s, {N_IMAGES} images at "
              f"{inproc['rps']} requests/s, {same}/{N_IMAGES} replies equal to the server's "
              f"({time.monotonic() - t0:.0f} s in all)", flush=True)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"vllm_check OK: vlm_ocr over HTTP {N_IMAGES}/{N_IMAGES} scored (mean {mean(http['scores']):.3f}) at "
              f"{http['rps_1']} req/s with 1 in flight, {http['rps_8']} req/s with 8; silent server "
              f"{timeouts['timeout_failed']}/4 timed out and counted; killed mid-run {killed['killed_failed']}/"
              f"{killed['killed_n']} failed and counted, returned {killed['after_kill_s']} s after the kill; "
              f"vllm_inprocess {N_IMAGES}/{N_IMAGES} scored (mean {mean(inproc['scores']):.3f}) at "
              f"{inproc['rps']} req/s, {same}/{N_IMAGES} replies as over HTTP; server start-up "
              f"{http['startup_s']} s", flush=True)
        server.kill()
        shutil.rmtree(work, ignore_errors=True)  # kept after a failure: the server log is in it
        return 0
    except CheckFailed as e:
        print(f"vllm_check FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"vllm_check FAILED: {' '.join(map(str, e.cmd))} exited with {e.returncode}:\n"
              f"{(e.stderr or b'')[-3000:].decode(errors='replace')}", file=sys.stderr, flush=True)
        return 1
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
