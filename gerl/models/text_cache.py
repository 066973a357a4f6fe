"""Prompt embeddings on disk, so that rollout hosts never load the text encoders.

`gerl prepare CONFIG` encodes every prompt a run can use — data.train_prompts, data.test_prompts, the family's
negative prompt — once, with the family's own `encode_prompts`, one prompt at a time as the rollouts' TextEmbedder
does (so a row never depends on which prompts shared its batch), and writes them to `model.text_cache`:

    index.json   what the rows depend on (the fingerprint), where each prompt's row is, the encoders' size
    prompt.bin   every prompt's token embeddings, one after another: (Σ Lᵢ, D) in the encoders' dtype
    pooled.bin   (N, P): the pooled vectors, for a family that has them (SD3, FLUX.1)

A run with `model.text_cache` set loads no text encoder on a rollout (or hybrid) host — T5-XXL is 9.5 GB in bf16,
Qwen2.5-VL-7B 16.6 GB — and logs that size as `text_encoders_freed_gib`. The rows are read through a private memory
map (torch.from_file, shared=False): the file's pages sit in the page cache once per node, and every host of the node
maps the same pages, where each held its own copy of the embeddings in RAM before (FLUX's 512-token rows for the OCR
prompt set: ≈ 12 GiB per host). A row is copied only into the micro-batch that uses it.

A cache is refused, in one line naming what changed, when a prompt file's contents, the model (its text encoders'
and tokenizers' files, model_index.json; a tiny model's seed), model.dtype or model.max_sequence_length differ from
what it was written with: rerun `gerl prepare`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from gerl.errors import UserError
from gerl.sampling.loop import Embeds

FORMAT = 1
INDEX = "index.json"
SMALL_FILE = 16 * 2**20  # files up to this size are hashed whole (configs, tokenizers); weights by name, size, mtime


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_identity(model) -> str:
    """What the text embeddings of `model` (ModelConfig) depend on, as a short string: a tiny model's name and seed; a
    directory's model_index.json and its text encoders' and tokenizers' files (small ones by content, weight files by
    name, size and modification time: hashing 9.5 GB on every start would cost minutes)."""
    from gerl.models.family import TINY_MODELS
    from gerl.models.loader import model_family, resolve_model_path

    if model.path in TINY_MODELS:
        return f"{model.path} (tiny_seed {model.tiny_seed})"
    root = Path(resolve_model_path(model.path))
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(model.path, local_files_only=True))
        except Exception:  # noqa: BLE001 — not in the local cache: the loader reports it
            return model.path
    family = model_family(model.path)
    h = hashlib.sha256()
    parts = [root / "model_index.json"] + [root / d for c, t in family.tokenizers.items() for d in (c, t)]
    for part in parts:
        files = sorted(part.rglob("*")) if part.is_dir() else [part] if part.exists() else []
        for f in files:
            if not f.is_file():
                continue
            st = f.stat()
            h.update(str(f.relative_to(root)).encode())
            h.update(_sha256(f).encode() if st.st_size <= SMALL_FILE else f"{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model.path} ({h.hexdigest()[:16]})"


def fingerprint(cfg) -> dict:
    """Everything the cached rows depend on; a run's own must equal the cache's."""
    files = {key: cfg_path for key, cfg_path in (("data.train_prompts", cfg.data.train_prompts),
                                                 ("data.test_prompts", cfg.data.test_prompts))}
    out = {"format": FORMAT, "model.path": model_identity(cfg.model), "model.dtype": cfg.model.dtype,
           "model.max_sequence_length": cfg.model.max_sequence_length}
    for key, path in files.items():
        try:
            out[key] = _sha256(Path(path))
        except OSError as e:
            raise UserError(f"{key}={path}: cannot read it ({e.strerror or e})") from None
    return out


def cache_prompts(cfg, family) -> list[str]:
    """The prompts a run can encode: every training and test prompt, and the negative prompt, each once."""
    from gerl.data.prompts import load_prompts

    texts = [p.text for p in load_prompts(cfg.data.train_prompts) + load_prompts(cfg.data.test_prompts)]
    return list(dict.fromkeys(texts + [family.negative_prompt]))


def read_index(d: Path) -> dict:
    redo = "run `gerl prepare` with this config to write it (or set model.text_cache= to encode prompts on the fly)"
    try:
        return json.loads((d / INDEX).read_text())
    except FileNotFoundError:
        raise UserError(f"model.text_cache={d} holds no prompt embeddings ({INDEX} is missing): {redo}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"model.text_cache={d}: {INDEX} is unreadable ({str(e)[:120]}): {redo}") from None


def check(cfg) -> dict:
    """The index of `model.text_cache` when it was written for this config; otherwise a UserError in one line. The
    driver checks (trainer.prepare), before any host starts; the hosts only read the index."""
    d = Path(cfg.model.text_cache)
    index = read_index(d)
    mine, theirs = fingerprint(cfg), index.get("fingerprint", {})
    changed = [k for k in mine if mine[k] != theirs.get(k)]
    if changed:
        files = {"data.train_prompts": cfg.data.train_prompts, "data.test_prompts": cfg.data.test_prompts}
        what = "; ".join(f"{k} ({files[k]}): its prompts changed" if k in files else
                         f"{k} changed ({theirs.get(k)!r} → {mine[k]!r})" for k in changed)
        raise UserError(f"model.text_cache={d} is stale: {what}; rerun `gerl prepare` with this config")
    return index


def write(cfg, pipe, family, device_bytes: int) -> Path:
    """Encode cache_prompts(cfg) with `pipe`'s text encoders and write model.text_cache (atomically: a reader sees
    the old cache or the new one). device_bytes: the text encoders' weights as loaded, recorded for the runs."""
    from gerl.models.loader import encode_rows

    d = Path(cfg.model.text_cache)
    tmp = d.with_name(f"{d.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prompts = cache_prompts(cfg, family)
    entries, offset = [], 0
    dtype = width = pooled_width = masked = None
    with open(tmp / "prompt.bin", "wb") as tokens, open(tmp / "pooled.bin", "wb") as pooled:
        for i in range(0, len(prompts), 64):
            for text, row in zip(prompts[i:i + 64], encode_rows(family, pipe, prompts[i:i + 64],
                                                                 cfg.model.max_sequence_length)):
                seq = row.prompt[0].contiguous()  # (L, D)
                dtype, width, masked = seq.dtype, seq.shape[1], row.mask is not None
                tokens.write(seq.view(torch.uint8).numpy().tobytes())
                if row.pooled is not None:
                    pooled_width = row.pooled.shape[1]
                    pooled.write(row.pooled[0].contiguous().view(torch.uint8).numpy().tobytes())
                entries.append([text, offset, seq.shape[0]])
                offset += seq.shape[0]
    index = {"fingerprint": fingerprint(cfg), "dtype": str(dtype).removeprefix("torch."), "width": width,
             "pooled_width": pooled_width, "masked": masked, "tokens": offset, "encoder_bytes": device_bytes,
             "prompts": entries}
    (tmp / INDEX).write_text(json.dumps(index))
    old = d.with_name(f"{d.name}.old-{os.getpid()}")
    if d.exists():
        d.rename(old)
    tmp.rename(d)
    shutil.rmtree(old, ignore_errors=True)  # hosts still mapping the old files keep them until they unmap
    return d


class DiskTextCache:
    """The rows of a written cache, memory-mapped: `row(prompt)` is an Embeds of batch 1 (a view, no copy) or None."""

    def __init__(self, cfg):
        d = Path(cfg.model.text_cache)  # checked against the config by the driver (check); a host may lack the prompts
        index = read_index(d)
        dtype = getattr(torch, index["dtype"])
        self.encoder_bytes = int(index["encoder_bytes"])
        self.masked = bool(index["masked"])
        self.tokens = torch.from_file(str(d / "prompt.bin"), shared=False, size=index["tokens"] * index["width"],
                                      dtype=dtype).view(index["tokens"], index["width"])
        n = len(index["prompts"])
        self.pooled = None
        if index["pooled_width"]:
            self.pooled = torch.from_file(str(d / "pooled.bin"), shared=False, size=n * index["pooled_width"],
                                          dtype=dtype).view(n, index["pooled_width"])
        self.where = {text: (i, offset, length) for i, (text, offset, length) in enumerate(index["prompts"])}

    def __contains__(self, prompt: str) -> bool:
        return prompt in self.where

    def __len__(self) -> int:
        return len(self.where)

    def row(self, prompt: str) -> Embeds:
        i, offset, length = self.where[prompt]
        seq = self.tokens[offset:offset + length].unsqueeze(0)
        pooled = self.pooled[i:i + 1] if self.pooled is not None else None
        mask = torch.ones(1, length, dtype=torch.long) if self.masked else None
        return Embeds(seq, pooled, mask=mask)


def prepare(cfg) -> tuple[Path, int, float]:
    """`gerl prepare`: load the text encoders alone on model.device, encode, write. Returns (directory, prompts,
    GiB of text-encoder weights that the runs reading it leave unloaded)."""
    from types import SimpleNamespace

    from gerl.models.loader import load_pipeline, model_family, resolve_device

    if not cfg.model.text_cache:
        raise UserError("gerl prepare writes the prompt embeddings to model.text_cache: set it, e.g. "
                        "model.text_cache=data/text_cache (a directory every rollout host can read)")
    family = model_family(cfg.model.path)
    if family is not None and family.conditioned:  # its rows encode a conditioning image too (the VAE)
        raise UserError(f"gerl prepare caches text-to-image prompts only: {family.title} encodes every prompt with "
                        "its conditioning image; unset model.text_cache for this model")
    encoders = tuple(family.tokenizers)  # the text encoders (each maps to its tokenizer)
    pipe = load_pipeline(cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.model.tiny_seed, encoders)
    device = resolve_device(cfg.model.device)
    # encode_prompts places its tensors on the transformer's device; the transformer itself is not needed here
    object.__setattr__(pipe, "transformer", SimpleNamespace(device=device))
    weights = {id(t): t for c in encoders for t in [*getattr(pipe, c).parameters(), *getattr(pipe, c).buffers()]}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    d = write(cfg, pipe, family, nbytes)
    return d, len(json.loads((d / INDEX).read_text())["prompts"]), nbytes / 2**30
