"""VLM rewards against a real OpenAI-compatible server: `transformers serve` running a tiny random LLaVA on CPU.

The random model answers with garbage bytes, so the OCR scores are low and the judge's replies carry no score:
the tests check that such replies are counted, never crash and never become made-up scores. vLLM itself (its CPU
build, over HTTP and in-process) runs in scripts/vllm_check.sh, `pytest -m vllm` (test_vllm_check.py): it needs a
venv of its own, so here only the in-process backend's not-installed error is checked.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import threading
import time

import numpy as np
import pytest
from PIL import Image

from gerl.errors import UserError
from rewards import vlm  # noqa: F401  (registers vlm_ocr and vlm_judge)
from rewards.ocr import ocr_score
from rewards.registry import build_reward, call_reward, registered_names, validate_reward_inputs
from rewards.vlm import parse_score
from rewards.vlm_client import image_data_url
from tests.rewards.tiny_llava import ServedModel, save_tiny_llava

SECRET = "sk-test-0123456789abcdef-never-log-me"


def _images(n: int, size: int = 48) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _dead_url() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    return save_tiny_llava(tmp_path_factory.mktemp("tiny_llava") / "model")


@pytest.fixture(scope="session")
def server(llava_dir, tmp_path_factory):
    served = ServedModel(llava_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    yield served
    served.stop()


# ---------------------------------------------------------------------------------------------- no server needed


@pytest.mark.parametrize("text, expected", [
    ("Final Score: 4", 0.75),
    ("element (object): 1\nelement (text): 0\nFinal Score: **2**", 0.25),
    ("The score is 3.5/5.", 0.625),
    ("Rating: 8/10", 0.75),  # another denominator: rescaled to the 1-5 scale
    ("**5**", 1.0),
    ('{"reason": "sharp", "score": 4}', 0.75),
    ("1", 0.0),
    ("Final Score: 9", 1.0),  # clamped to the scale
    ("scale 1 to 5 ... Final Score: 3", 0.5),
    ("\ufffd'a\x11\ufffd the image has 3 cats", None),
    ("", None),
    (None, None),
])
def test_parse_score(text, expected):
    assert parse_score(text, 1, 5) == expected


def test_parse_score_custom_scale():
    assert parse_score("Final Score: 7", 0, 10) == 0.7
    assert parse_score("score: 7/10", 0, 10) == 0.7


def test_image_data_url_is_lossless_png():
    image = _images(1)[0]
    url = image_data_url(image)
    assert url.startswith("data:image/png;base64,")
    back = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert np.array_equal(np.asarray(back), np.asarray(image))


def test_settings_from_env_and_key_kept_out_of_repr_and_pickle(monkeypatch):
    assert {"vlm_ocr", "vlm_judge"} <= set(registered_names())
    monkeypatch.setenv("GERL_VLM_BASE_URL", "http://example.invalid:8000/v1")
    monkeypatch.setenv("GERL_VLM_MODEL", "Qwen/Qwen2.5-VL-7B-Instruct")
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    reward = build_reward("vlm_ocr", {})
    assert reward.client.base_url == "http://example.invalid:8000/v1"
    assert reward.client.model == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert SECRET not in repr(reward) and "***" in repr(reward)
    copy = pickle.loads(pickle.dumps(reward))  # process pools ship the reward by pickle
    assert copy.client.model == reward.client.model and copy.client._pool is None
    monkeypatch.delenv("GERL_VLM_BASE_URL")
    with pytest.raises(UserError, match="GERL_VLM_BASE_URL"):
        build_reward("vlm_ocr", {})
    with pytest.raises(UserError, match="bogus"):
        build_reward("vlm_judge", {"bogus": 1})
    with pytest.raises(UserError, match=r"\{prompt\}"):
        build_reward("vlm_judge", {"base_url": "http://x/v1", "question": "Rate it."})


def test_vllm_inprocess_backend():
    """Only the not-installed error in gerl's venv; vLLM's CPU build runs it in test_vllm_check.py (`-m vllm`)."""
    import importlib.util

    kwargs = {"backend": "vllm_inprocess", "model": "Qwen/Qwen2.5-VL-7B-Instruct"}
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UserError, match=r"pip install 'gerl\[vllm\]'"):
            build_reward("vlm_ocr", kwargs)
    else:  # with vLLM installed the factory stays cheap: the engine loads on the first call
        assert build_reward("vlm_ocr", kwargs).client._llm is None
    with pytest.raises(UserError, match="base_url"):
        build_reward("vlm_ocr", {**kwargs, "base_url": "http://127.0.0.1:1/v1"})


def test_health_check_on_dead_port_names_the_url():
    url = _dead_url()
    reward = build_reward("vlm_judge", {"base_url": url, "model": "m", "api_key": SECRET})
    with pytest.raises(UserError, match=url.replace(".", r"\.")) as err:
        validate_reward_inputs(reward, ["a cat"], [{}])
    assert "not reachable" in str(err.value) and SECRET not in str(err.value)


def test_vlm_ocr_validate_checks_targets_before_the_server():
    reward = build_reward("vlm_ocr", {"base_url": _dead_url(), "model": "m"})
    with pytest.raises(UserError, match=r"1 of 2 prompts have no target text.*#2"):
        reward.validate(['a sign saying "OPEN"', "a plain wall"], [{}, {}])


def test_dead_server_gives_none_and_counts_failures_after_bounded_retries():
    reward = build_reward("vlm_ocr", {"base_url": _dead_url(), "model": "m", "max_retries": 2, "timeout_s": 2.0})
    reward.client.backoff_s = 0.05
    t0 = time.monotonic()
    scores, extras = call_reward(reward, _images(3), ['say "HI"', 'say "HO"', "no target"], [{}, {}, {}])
    assert time.monotonic() - t0 < 5
    assert scores == [None, None, None]
    assert extras["vlm_failed"] == [1, 1, 0]  # the sample without a target is not applicable, not a failure
    replies = reward.client.chat_many([[{"type": "text", "text": "x"}]])
    assert replies[0].attempts == 3 and replies[0].text is None


# ------------------------------------------------------------------------------------- against transformers serve


def test_health_check_and_model_probe(server):
    good = build_reward("vlm_ocr", {"base_url": server.base_url, "model": server.model})
    good.validate(['a sign saying "OPEN"'], [{}])  # /v1/models lists nothing here: the probe request answers
    wrong_model = build_reward("vlm_ocr", {"base_url": server.base_url, "model": "not/served"})
    with pytest.raises(UserError, match=r"does not answer for model 'not/served'.*HTTP 400"):
        wrong_model.validate(['a sign saying "OPEN"'], [{}])
    no_v1 = build_reward("vlm_ocr", {"base_url": server.base_url[: -len("/v1")], "model": server.model})
    with pytest.raises(UserError, match=r"HTTP 404.*ends in /v1"):
        no_v1.validate(['a sign saying "OPEN"'], [{}])


def test_vlm_ocr_concurrent_requests_score_every_reply(server):
    n = 16
    reward = build_reward("vlm_ocr", {"base_url": server.base_url, "model": server.model, "max_concurrency": 8,
                                      "max_tokens": 8})
    prompts = [f'a poster with the words "GERL {i}"' for i in range(n)]
    scores, extras = call_reward(reward, _images(n), prompts, [{}] * n)
    assert extras["vlm_failed"] == [0] * n
    for score, text, i in zip(scores, extras["vlm_text"], range(n)):
        assert score == ocr_score(text, f"GERL {i}") and 0.0 <= score <= 1.0
    assert server.max_overlap() >= 2, "the server never held two requests at once"


def test_vlm_judge_garbage_replies_become_counted_parse_failures(server):
    n = 6
    reward = build_reward("vlm_judge", {"base_url": server.base_url, "model": server.model, "max_tokens": 8})
    scores, extras = call_reward(reward, _images(n), ["a red cube on a table"] * n, [{}] * n)
    assert extras["vlm_failed"] == [0] * n
    assert sum(extras["vlm_parse_failed"]) >= 1, "the random model should not produce a readable score"
    for score, text, unparsed in zip(scores, extras["vlm_text"], extras["vlm_parse_failed"]):
        assert score == parse_score(text, 1, 5)
        assert (score is None) == bool(unparsed)


def test_api_key_never_in_logs_errors_or_extras(server, caplog, monkeypatch):
    monkeypatch.setenv("GERL_VLM_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    ok = build_reward("vlm_judge", {"base_url": server.base_url, "model": server.model, "max_tokens": 4})
    _, extras = call_reward(ok, _images(2), ["a cat", "a dog"], [{}, {}])  # garbage replies: a warning is logged
    dead = build_reward("vlm_judge", {"base_url": _dead_url(), "model": server.model, "max_retries": 0})
    _, dead_extras = call_reward(dead, _images(2), ["a cat", "a dog"], [{}, {}])  # failures: a warning is logged
    with pytest.raises(UserError) as err:
        dead.validate(["a cat"], [{}])
    assert "VLM requests failed" in caplog.text and "no readable score" in caplog.text
    for text in (caplog.text, str(err.value), repr(ok), repr(dead), repr(extras), repr(dead_extras)):
        assert SECRET not in text
    assert ok.client._api_key == SECRET  # it was really in use


def test_server_killed_mid_run_fails_remaining_requests_without_hanging(llava_dir, tmp_path):
    served = ServedModel(llava_dir, tmp_path / "serve.log")
    try:
        n = 40  # enough that some are still queued when the server dies, however fast the first ones come back
        # timeout_s far above a reply's time on a loaded machine and above the bound after the kill below: the
        # requests in flight when the server dies must fail on the dropped connection, not on their timeout
        reward = build_reward("vlm_ocr", {"base_url": served.base_url, "model": served.model,
                                          "max_concurrency": 2, "max_retries": 1, "timeout_s": 60.0,
                                          "max_tokens": 8})
        reward.client.backoff_s = 0.1
        answered = threading.Event()  # a reply has reached the client: the kill comes after at least one success
        chat = reward.client.chat

        def chat_and_tell(*args, **kwargs):
            reply = chat(*args, **kwargs)
            if reply.text is not None:
                answered.set()
            return reply

        reward.client.chat = chat_and_tell
        out: dict = {}
        worker = threading.Thread(target=lambda: out.update(r=call_reward(
            reward, _images(n), [f'say "W{i}"' for i in range(n)], [{}] * n)))
        worker.start()
        assert answered.wait(300), f"no reply within 300 s:\n{served.log()[-3000:]}"
        served.kill()
        t_kill = time.monotonic()
        # After the kill: the connections in flight drop, each request gets one backoff and a refused retry.
        worker.join(120)
        assert not worker.is_alive(), "reward call hung after the server died"
        assert time.monotonic() - t_kill < 30, "a request waited for its timeout after the server died"
        scores, extras = out["r"]
        failed = extras["vlm_failed"]
        assert 1 <= sum(failed) < n, f"expected some requests before and some after the kill, got {failed}"
        assert all((s is None) == bool(f) for s, f in zip(scores, failed))
    finally:
        served.stop()


def test_serve_script_usage_and_missing_vllm(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "serve_vlm_reward.sh"
    assert "vllm serve" in script.read_text() and "--limit-mm-per-prompt" in script.read_text()
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no vllm on PATH
    bad = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    missing = subprocess.run(["bash", str(script), "judge"], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "pip install 'gerl[vllm]'" in missing.stderr
