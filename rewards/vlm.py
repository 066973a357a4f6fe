"""Rewards that ask a vision-language model about each image (GeRL's "qwenvl-ocr-vllm" and "unified-reward-vllm").

- `vlm_ocr`: the VLM transcribes the text in the image; the transcription is scored against the prompt's quoted
  target with the OCR reward's own `ocr_score` (Flow-GRPO's normalised edit distance, in [0, 1]).
- `vlm_judge`: UnifiedReward-style judgement of prompt alignment and image quality, ending in
  "Final Score: N" on a [min_score, max_score] scale; the number is parsed (`parse_score`) and mapped linearly
  onto [0, 1]. GeRL divides by max_score instead — an affine difference that group-normalised advantages erase.

The model runs behind an OpenAI-compatible server (`backend: http`, e.g. `vllm serve`, see
scripts/serve_vlm_reward.sh) or inside this process (`backend: vllm_inprocess`). Settings come from the reward
kwargs, else from GERL_VLM_BASE_URL, GERL_VLM_MODEL and GERL_VLM_API_KEY / OPENAI_API_KEY.

A request that still fails after its retries scores None and is counted in the per-sample extras
(`vlm_failed`); a `vlm_judge` reply with no readable score scores None and is counted in `vlm_parse_failed`.
Neither is ever turned into a made-up score. `validate()` (called once by the trainer) checks the server is up.
"""

from __future__ import annotations

import json
import logging
import re

from gerl.errors import UserError
from rewards.ocr import ocr_score, target_for
from rewards.registry import register
from rewards.vlm_client import ChatClient, Reply, make_client

logger = logging.getLogger(__name__)

OCR_QUESTION = "Please output only the text content from the image without any additional descriptions or formatting."
JUDGE_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image using the "
    "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and assign a "
    "score from {min_score:g} to {max_score:g} after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)

_NUM = r"([-+]?\d+(?:\.\d+)?)"
_OUT_OF = r"(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?"
# Most specific first; within a pattern the *last* match wins (models restate the scale before answering).
_SCORE_PATTERNS = [
    re.compile(r"final\s*score\W{0,6}?" + _NUM + _OUT_OF, re.I),
    re.compile(r"\b(?:overall\s+)?(?:score|rating)\s*(?:is|of|=|:|：)?[\s*]*" + _NUM + _OUT_OF, re.I),
    re.compile(r"\*\*\s*" + _NUM + _OUT_OF + r"\s*\*\*"),
    re.compile(r"^\W*" + _NUM + _OUT_OF + r"\W*$"),  # the whole reply is the number
]
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_JSON_KEYS = ("final_score", "score", "rating")


def parse_score(text: str | None, min_score: float = 1.0, max_score: float = 5.0) -> float | None:
    """The judge's score in `text` mapped onto [0, 1], or None when there is no readable score.

    Reads, in order: a JSON object with a "final_score" / "score" / "rating" key; "Final Score: 4"; "score: 3.5/5",
    "Rating is 4 out of 5"; a bold "**4**"; a reply that is just the number. A score given out of another
    denominator ("8/10") is rescaled to max_score; the result is clamped to the scale, then mapped linearly.
    """
    if not text:
        return None
    value = _json_score(text)
    if value is None:
        for pattern in _SCORE_PATTERNS:
            matches = pattern.findall(text)
            if matches:
                number, out_of = matches[-1]
                value = float(number)
                if out_of and float(out_of) > 0 and float(out_of) != max_score:
                    value = value * max_score / float(out_of)
                break
    if value is None or value != value:  # NaN
        return None
    value = min(max(value, min_score), max_score)
    return (value - min_score) / (max_score - min_score)


def _json_score(text: str) -> float | None:
    for blob in reversed(_JSON_OBJECT.findall(text)):
        try:
            obj = json.loads(blob)
        except ValueError:
            continue
        lowered = {str(k).lower(): v for k, v in obj.items()} if isinstance(obj, dict) else {}
        for key in _JSON_KEYS:
            if isinstance(lowered.get(key), (int, float)) and not isinstance(lowered[key], bool):
                return float(lowered[key])
            if isinstance(lowered.get(key), str):
                try:
                    return float(lowered[key].split("/")[0])
                except ValueError:
                    pass
    return None


class _VlmReward:
    """Holds the client and its settings; subclasses say what to ask and how to score the reply."""

    name = "vlm"

    def __init__(self, *, backend, base_url, model, api_key, max_concurrency, timeout_s, max_retries, max_tokens,
                 temperature, engine_kwargs):
        self.client = make_client(backend, base_url=base_url, model=model, api_key=api_key,
                                  max_concurrency=max_concurrency, timeout_s=timeout_s, max_retries=max_retries,
                                  max_tokens=max_tokens, temperature=temperature, engine_kwargs=engine_kwargs,
                                  who=self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(client={self.client!r})"

    def check_server(self) -> None:
        """Raise UserError when the server is down, rejects the key, or does not serve `model`."""
        served = self.client.health()
        if self.client.model in served or not isinstance(self.client, ChatClient):
            return
        # Not listed: servers that pin one model under another name (transformers serve lists its cache) still
        # answer, so ask once with a tiny text-only request and trust what it says.
        reply = self.client.chat([{"type": "text", "text": "Reply with OK."}], max_tokens=1)
        if reply.text is None:
            listed = ", ".join(served) or "(none listed)"
            raise UserError(
                f"{self.name}: VLM server {self.client.base_url} does not answer for model {self.client.model!r} "
                f"({reply.error[:160]}); served models: {listed}; set reward.kwargs.model / GERL_VLM_MODEL to one"
            )

    def ask(self, images, questions: list[str]) -> list[Reply]:
        """One question per image, concurrently; logs a one-line summary of any failed requests."""
        replies = self.client.ask(images, questions)
        failed = [r for r in replies if r.text is None]
        if failed:
            logger.warning("%s: %d of %d VLM requests failed after %d attempt(s); first error: %s", self.name,
                           len(failed), len(replies), failed[0].attempts, failed[0].error[:200])
        return replies


class VlmOcrReward(_VlmReward):
    """Ask a VLM to transcribe each image; score the transcription against the prompt's quoted target text.

    Args: see `vlm_ocr`.
    """

    name = "vlm_ocr"

    def __init__(self, question: str = OCR_QUESTION, **client_kwargs):
        super().__init__(**client_kwargs)
        self.question = question

    def __call__(self, images, prompts, metadata) -> tuple[list[float | None], dict[str, list]]:
        """Returns (scores, {"vlm_text": replies ("" if failed), "vlm_failed": 1 where the request failed}).

        A sample with no target text scores None (not applicable) without a request.
        """
        targets = [target_for(p, m) for p, m in zip(prompts, metadata)]
        todo = [i for i, t in enumerate(targets) if t is not None]
        replies = dict(zip(todo, self.ask([images[i] for i in todo], [self.question] * len(todo))))
        scores, texts, failed = [], [], []
        for i, target in enumerate(targets):
            reply = replies.get(i)
            text = reply.text if reply is not None else None
            scores.append(ocr_score(text, target) if text is not None else None)
            texts.append(text or "")
            failed.append(int(reply is not None and text is None))
        # "failed" is the executor's contract: these samples go to reward.on_failure, not "not applicable"
        return scores, {"vlm_text": texts, "vlm_failed": failed, "failed": list(failed)}

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """Every prompt needs a target text; then the server must be up and serve the model."""
        metadata = metadata or [{}] * len(prompts)
        bad = [i for i, (p, m) in enumerate(zip(prompts, metadata)) if target_for(p, m) is None]
        if bad:
            raise UserError(
                f"vlm_ocr: {len(bad)} of {len(prompts)} prompts have no target text, first is prompt #{bad[0] + 1} "
                f"{prompts[bad[0]][:80]!r}; put the text to render in \"double quotes\" in each prompt or give a "
                f"non-empty target_text field (.jsonl)"
            )
        self.check_server()


class VlmJudgeReward(_VlmReward):
    """UnifiedReward-style judge: alignment and quality, a final score on [min_score, max_score] mapped to [0, 1].

    Args: see `vlm_judge`.
    """

    name = "vlm_judge"

    def __init__(self, question: str = JUDGE_QUESTION, min_score: float = 1.0, max_score: float = 5.0,
                 **client_kwargs):
        if not float(max_score) > float(min_score):
            raise UserError(f"vlm_judge: max_score ({max_score}) must be greater than min_score ({min_score})")
        if "{prompt}" not in question:
            raise UserError("vlm_judge: question must contain '{prompt}' where the caption goes "
                            "(and may use {min_score} and {max_score})")
        try:
            question.format(prompt="", min_score=0, max_score=0)
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(f"vlm_judge: question has a bad placeholder ({e!r}); only {{prompt}}, {{min_score}} and "
                            f"{{max_score}} are filled in, write literal braces as {{{{ and }}}}")
        super().__init__(**client_kwargs)
        self.question = question
        self.min_score, self.max_score = float(min_score), float(max_score)

    def __call__(self, images, prompts, metadata) -> tuple[list[float | None], dict[str, list]]:
        """Returns (scores, {"vlm_text", "vlm_failed": request failed, "vlm_parse_failed": reply had no score})."""
        questions = [self.question.format(prompt=p, min_score=self.min_score, max_score=self.max_score)
                     for p in prompts]
        scores, texts, failed, unparsed = [], [], [], []
        for reply in self.ask(images, questions):
            score = parse_score(reply.text, self.min_score, self.max_score)
            scores.append(score)
            texts.append(reply.text or "")
            failed.append(int(reply.text is None))
            unparsed.append(int(reply.text is not None and score is None))
        if any(unparsed):
            logger.warning("%s: %d of %d replies had no readable score, e.g. %r", self.name, sum(unparsed),
                           len(unparsed), next(t for t, u in zip(texts, unparsed) if u)[:120])
        # an unparseable judgement is a failure for the fault policy, like a failed request
        both = [int(bool(a) or bool(b)) for a, b in zip(failed, unparsed)]
        return scores, {"vlm_text": texts, "vlm_failed": failed, "vlm_parse_failed": unparsed, "failed": both}

    def validate(self, prompts: list[str], metadata: list[dict]) -> None:
        """The server must be up and serve the model."""
        self.check_server()


@register("vlm_ocr")
def vlm_ocr(
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    backend: str = "http",
    max_concurrency: int = 8,
    timeout_s: float = 60.0,
    max_retries: int = 2,
    max_tokens: int = 128,
    temperature: float = 0.0,
    question: str = OCR_QUESTION,
    engine_kwargs: dict | None = None,
) -> VlmOcrReward:
    """OCR by a VLM, scored like `ocr` (GeRL's qwenvl-ocr-vllm).

    Args:
        base_url: OpenAI API root of the server, e.g. "http://127.0.0.1:8000/v1" (default: $GERL_VLM_BASE_URL).
        model: the model name the server serves (default: $GERL_VLM_MODEL); for vllm_inprocess a hub id or path.
        api_key: bearer token (default: $GERL_VLM_API_KEY, then $OPENAI_API_KEY). Prefer the environment: kwargs
            are copied into the run's config.yaml.
        backend: "http" (a server) or "vllm_inprocess" (a vllm.LLM in this process; pip install 'gerl[vllm]').
        max_concurrency: requests in flight at once per reward object (the server batches them).
        timeout_s: socket timeout of one request attempt, seconds.
        max_retries: extra attempts after a connection error, timeout, 429 or 5xx (exponential backoff from 0.5 s).
        max_tokens: longest reply; the target texts are short.
        temperature: 0 = greedy, the deterministic reading a reward wants.
        question: the instruction sent with each image.
        engine_kwargs: vllm.LLM arguments (vllm_inprocess only), e.g. {"gpu_memory_utilization": 0.4}.
    """
    return VlmOcrReward(question, backend=backend, base_url=base_url, model=model, api_key=api_key,
                        max_concurrency=max_concurrency, timeout_s=timeout_s, max_retries=max_retries,
                        max_tokens=max_tokens, temperature=temperature, engine_kwargs=engine_kwargs)


@register("vlm_judge")
def vlm_judge(
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    backend: str = "http",
    max_concurrency: int = 8,
    timeout_s: float = 120.0,
    max_retries: int = 2,
    max_tokens: int = 512,
    temperature: float = 0.0,
    min_score: float = 1.0,
    max_score: float = 5.0,
    question: str = JUDGE_QUESTION,
    engine_kwargs: dict | None = None,
) -> VlmJudgeReward:
    """UnifiedReward-style VLM judge of alignment and quality (GeRL's unified-reward-vllm), in [0, 1].

    Args:
        min_score, max_score: the scale the judge is asked to use; min_score maps to 0 and max_score to 1.
        question: the instruction template; {prompt}, {min_score} and {max_score} are filled in.
        max_tokens: longest reply; UnifiedReward lists the caption's elements before its final score.
        Others: as for `vlm_ocr`.
    """
    return VlmJudgeReward(question, min_score, max_score, backend=backend, base_url=base_url, model=model,
                          api_key=api_key, max_concurrency=max_concurrency, timeout_s=timeout_s,
                          max_retries=max_retries, max_tokens=max_tokens, temperature=temperature,
                          engine_kwargs=engine_kwargs)
