"""Clients that put one question about one image to a vision-language model, many at a time.

Two backends share one interface (`health() -> served model names`, `chat_many(contents) -> list[Reply]`):

- `ChatClient` (backend "http"): any OpenAI-compatible `/chat/completions` server — `vllm serve` in production,
  `transformers serve` in tests, SGLang or a hosted API. Stdlib HTTP on a thread pool: up to `max_concurrency`
  requests are in flight at once (the server batches them), each with a socket timeout and a bounded number of
  retries with exponential backoff. A request that still fails gives `Reply(text=None, error=...)`, never a
  made-up answer.
- `VllmEngineClient` (backend "vllm_inprocess"): a `vllm.LLM` engine inside this process (a dedicated GPU),
  imported and loaded on first use; `pip install 'gerl[vllm]'`.

The API key is sent only in the Authorization header: it is kept out of repr, logs and error messages.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import io
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gerl.errors import UserError

logger = logging.getLogger(__name__)

ENV_BASE_URL = "GERL_VLM_BASE_URL"
ENV_MODEL = "GERL_VLM_MODEL"
ENV_API_KEYS = ("GERL_VLM_API_KEY", "OPENAI_API_KEY")  # first one set wins
BACKENDS = ("http", "vllm_inprocess")
# Worth another try: the server is busy, restarting or briefly unreachable. Other 4xx are our request's fault.
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 8.0


@dataclass
class Reply:
    """One answer: `text`, or None with `error` saying why (after `attempts` tries)."""

    text: str | None
    error: str = ""
    attempts: int = 1


def image_data_url(image) -> str:
    """A PIL image as a `data:image/png;base64,...` URL (PNG: lossless, so OCR sees exactly what was generated)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=1)  # level 1: ~5x faster than 6, same pixels
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def image_content(image, question: str) -> list[dict]:
    """The content of one user message: the image, then the question (the order Qwen-VL was trained on)."""
    return [{"type": "image_url", "image_url": {"url": image_data_url(image)}}, {"type": "text", "text": question}]


def make_client(backend: str, *, base_url, model, api_key, max_concurrency: int, timeout_s: float,
                max_retries: int, max_tokens: int, temperature: float, engine_kwargs: dict | None, who: str):
    """Build the client for `backend`, resolving unset settings from the environment. Raises UserError."""
    if backend not in BACKENDS:
        raise UserError(f"{who}: unknown backend {backend!r}; set reward.kwargs.backend to one of {list(BACKENDS)}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"{who}: max_tokens must be an int >= 1, got {max_tokens!r}")
    model = model or os.environ.get(ENV_MODEL)
    if not model:
        raise UserError(f"{who}: no VLM model named; set reward.kwargs.model or {ENV_MODEL} to the name the server "
                        f"serves (e.g. Qwen/Qwen2.5-VL-7B-Instruct)")
    if backend == "vllm_inprocess":
        if base_url is not None or api_key is not None:
            raise UserError(f"{who}: base_url and api_key only apply to backend 'http'; remove them for "
                            f"backend 'vllm_inprocess'")
        return VllmEngineClient(model, max_tokens, temperature, engine_kwargs, who)
    if engine_kwargs:
        raise UserError(f"{who}: engine_kwargs only apply to backend 'vllm_inprocess'; remove them for backend 'http'")
    base_url = base_url or os.environ.get(ENV_BASE_URL)
    if not base_url:
        raise UserError(f"{who}: no VLM server URL; set reward.kwargs.base_url or {ENV_BASE_URL} "
                        f"(e.g. http://127.0.0.1:8000/v1, see scripts/serve_vlm_reward.sh)")
    if not str(base_url).startswith(("http://", "https://")):
        raise UserError(f"{who}: base_url {base_url!r} must start with http:// or https://")
    if api_key is None:
        api_key = next((os.environ[k] for k in ENV_API_KEYS if os.environ.get(k)), None)
    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise UserError(f"{who}: max_concurrency must be an int >= 1, got {max_concurrency!r}")
    if not timeout_s or timeout_s <= 0:
        raise UserError(f"{who}: timeout_s must be > 0 seconds, got {timeout_s!r}")
    if not isinstance(max_retries, int) or max_retries < 0:
        raise UserError(f"{who}: max_retries must be an int >= 0, got {max_retries!r}")
    return ChatClient(str(base_url), model, api_key, max_concurrency=max_concurrency, timeout_s=float(timeout_s),
                      max_retries=max_retries, max_tokens=max_tokens, temperature=float(temperature))


class ChatClient:
    """OpenAI-compatible chat-completions client with bounded concurrency, timeouts and retries.

    Args:
        base_url: the API root, e.g. "http://127.0.0.1:8000/v1" (endpoints are appended to it).
        model: the model name the server serves (the `model` field of each request).
        api_key: sent as "Authorization: Bearer ..." when not None; never logged.
        max_concurrency: requests in flight at once, shared by every call on this client (and so by every reward
            thread holding it).
        timeout_s: socket timeout of one attempt (connect, and each read), seconds.
        max_retries: extra attempts after a connection error, timeout or retryable HTTP status (429, 5xx).
        backoff_s: sleep before the first retry; doubles on each further retry (capped at 8 s).
        max_tokens, temperature: generation settings of every request (temperature 0 = greedy).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, max_concurrency: int = 8,
                 timeout_s: float = 60.0, max_retries: int = 2, backoff_s: float = 0.5, max_tokens: int = 256,
                 temperature: float = 0.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        key = "***" if self._api_key else None
        return f"ChatClient(base_url={self.base_url!r}, model={self.model!r}, api_key={key})"

    # The pool and lock cannot be pickled; a copy sent to a reward worker process makes its own on first use.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pool", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _pool=None, _lock=threading.Lock())

    def health(self) -> list[str]:
        """GET {base_url}/models: the served model names. Raises UserError naming the URL if it is not healthy."""
        url = f"{self.base_url}/models"
        try:
            with self._open(url, None, timeout=min(self.timeout_s, 10.0)) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise UserError(f"VLM server {url} rejected the API key (HTTP {e.code}); set {ENV_API_KEYS[0]} or "
                                f"{ENV_API_KEYS[1]} (or reward.kwargs.api_key) to a key it accepts") from None
            hint = " (base_url is the API root and usually ends in /v1)" if e.code == 404 else ""
            raise UserError(f"VLM server health check GET {url} failed with HTTP {e.code}{hint}; "
                            f"fix reward.kwargs.base_url / {ENV_BASE_URL} or the server") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise UserError(f"VLM server {url} is not reachable ({self._scrub(_reason(e))}); start it "
                            f"(scripts/serve_vlm_reward.sh) or fix reward.kwargs.base_url / {ENV_BASE_URL}") from None
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            raise UserError(f"GET {url} did not return JSON; base_url must be the root of an OpenAI-compatible API "
                            f"(usually ending in /v1)") from None
        data = payload.get("data") if isinstance(payload, dict) else None
        return [str(m.get("id")) for m in data or [] if isinstance(m, dict)]

    def chat(self, content: list[dict], max_tokens: int | None = None) -> Reply:
        """One user message → the assistant's reply, with retries. Never raises for server or network faults."""
        body = json.dumps({
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": self.temperature,
        }).encode()
        url = f"{self.base_url}/chat/completions"
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                with self._open(url, body, timeout=self.timeout_s) as resp:
                    payload = json.loads(resp.read())
                return Reply(_message_text(payload), attempts=attempt + 1)
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {_snippet(e)}"
                if e.code not in RETRY_STATUS:
                    return Reply(None, self._scrub(error), attempt + 1)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut off, timeout
                error = _reason(e)
            except (ValueError, KeyError, IndexError, TypeError) as e:  # 200 with a body that is not a chat reply
                return Reply(None, self._scrub(f"malformed response: {type(e).__name__}: {e}"), attempt + 1)
        return Reply(None, self._scrub(error), self.max_retries + 1)

    def chat_many(self, contents: list[list[dict]], max_tokens: int | None = None) -> list[Reply]:
        """`chat` for each content, up to `max_concurrency` in flight at once; replies in input order."""
        if not contents:
            return []
        if len(contents) == 1:
            return [self.chat(contents[0], max_tokens)]
        pool = self._executor()
        futures = [pool.submit(self.chat, c, max_tokens) for c in contents]
        return [f.result() for f in futures]

    def ask(self, images, questions: list[str]) -> list[Reply]:
        """One question about each image, concurrently; the PNG encoding runs in the pool threads too."""
        if len(images) <= 1:
            return [self._ask_one(im, q) for im, q in zip(images, questions)]
        pool = self._executor()
        futures = [pool.submit(self._ask_one, im, q) for im, q in zip(images, questions)]
        return [f.result() for f in futures]

    def _ask_one(self, image, question: str) -> Reply:
        return self.chat(image_content(image, question))

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="vlm-http")
            return self._pool

    def _open(self, url: str, body: bytes | None, timeout: float):
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
        return urllib.request.urlopen(req, timeout=timeout)

    def _scrub(self, text: str) -> str:
        # A misbehaving server or proxy could echo the request headers back in an error body.
        return text.replace(self._api_key, "***") if self._api_key else text


class VllmEngineClient:
    """An in-process `vllm.LLM` (loaded on first `chat_many`); calls from several threads are serialised.

    Args:
        model: hub id or local path of the VLM.
        max_tokens, temperature: sampling settings.
        engine_kwargs: extra `vllm.LLM(...)` arguments; defaults: max_model_len 4096, limit_mm_per_prompt
            {"image": 1}, gpu_memory_utilization 0.9 (the engine is meant to own its GPU: run the reward with
            `reward.pool: process` and pick the GPU with CUDA_VISIBLE_DEVICES, or give it a spare fraction).
    """

    def __init__(self, model: str, max_tokens: int, temperature: float, engine_kwargs: dict | None, who: str):
        if importlib.util.find_spec("vllm") is None:
            raise UserError(f"{who}: backend 'vllm_inprocess' needs vLLM: pip install 'gerl[vllm]' "
                            f"(or serve the model with scripts/serve_vlm_reward.sh and use backend 'http')")
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.engine_kwargs = {"max_model_len": 4096, "limit_mm_per_prompt": {"image": 1}, **(engine_kwargs or {})}
        self._llm = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VllmEngineClient(model={self.model!r})"

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_llm", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _llm=None, _lock=threading.Lock())

    def health(self) -> list[str]:
        return [self.model]  # nothing to reach; loading the engine here would hold a GPU in the wrong process

    def chat_many(self, contents: list[list[dict]], max_tokens: int | None = None) -> list[Reply]:
        if not contents:
            return []
        with self._lock:  # vllm.LLM is not thread-safe; one call already batches the whole micro-batch
            try:
                llm = self._load()
                from vllm import SamplingParams

                params = SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=self.temperature)
                outputs = llm.chat([[{"role": "user", "content": c}] for c in contents], params, use_tqdm=False)
                return [Reply(o.outputs[0].text if o.outputs else None, "" if o.outputs else "no output")
                        for o in outputs]
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 — an engine fault fails this batch's samples, not the run
                return [Reply(None, f"vllm engine: {type(e).__name__}: {e}") for _ in contents]

    def ask(self, images, questions: list[str]) -> list[Reply]:
        return self.chat_many([image_content(im, q) for im, q in zip(images, questions)])

    def close(self) -> None:
        pass

    def _load(self):
        if self._llm is None:
            try:
                import vllm
            except ImportError as e:
                raise UserError(f"backend 'vllm_inprocess' failed to import vLLM ({e}); pip install 'gerl[vllm]'")
            self._llm = vllm.LLM(model=self.model, **self.engine_kwargs)
        return self._llm


# --------------------------------------------------------------------------------------------------------------


def _message_text(payload: dict) -> str:
    content = payload["choices"][0]["message"]["content"]
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason


def _snippet(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read(300).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 — the body is only decoration for the message
        text = ""
    return " ".join(text.split())[:200] or str(e.reason)
