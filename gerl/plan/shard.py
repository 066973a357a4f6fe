"""The data-parallel layer in `gerl plan` (gerl/engine/parallel.py): what each actor rank holds, and what it gathers.

Three layouts, by engine.fsdp and the number of actor ranks N (engine.actor_workers; torchrun's processes):
- plain (one rank, engine.fsdp=false): every tensor whole. Weights trained in bf16/fp16 have fp32 masters
  (gerl/workers/masters.py): the optimizer, its moments, the gradients it reads, the EMA and the anchor are fp32.
- replicas (N > 1, engine.fsdp=false; FSDP2's replicate, DDP's contract): every tensor whole, as plain. Full
  fine-tuning stores its weights in fp32 with a model-dtype copy that FSDP2 casts for the forwards (the same bytes as
  plain's masters); a LoRA replicates only its fp32 adapter. In a backward each block's gradients pass through an fp32
  all-reduce buffer (and, for bf16/fp16 weights, first exist in the compute dtype): the largest block's is counted.
- shards (engine.fsdp=true, any N): FSDP2's fully_shard cuts every parameter along dim 0 into N chunks of
  ceil(rows / N) rows (the last padded) and a rank keeps one: of the trained weights (fp32, the masters), their
  gradients and AdamW moments, the EMA, the anchor, the frozen reference (in the model dtype), and of a LoRA's frozen
  base (model dtype) and adapter (fp32). Whole weights exist only while they compute, in the compute dtype: the root's
  own (embedders, norms, output projection) through the forward, and two blocks at a time — the one computing and the
  next, whose all-gather FSDP2 issues ahead of it on a GPU — and in a backward also the block's gradients in the
  compute dtype and their fp32 reduce-scatter input. That gather is added to every phase that runs the sharded
  transformer (training, and a hybrid host's generation).
"""

from __future__ import annotations

import math

import torch

from gerl.config import Config


def ranks(cfg: Config) -> int:
    """Actor ranks the data-parallel layer spans."""
    return cfg.engine.actor_workers


def layout(cfg: Config) -> str:
    """"shards", "replicas" or "plain" (see the module docstring)."""
    if cfg.engine.fsdp:
        return "shards"
    return "replicas" if ranks(cfg) > 1 else "plain"


def held(t: torch.Tensor, n: int) -> int:
    """Elements of `t` a rank holds when FSDP2 shards it over n ranks: ceil(rows / n) rows (n = 1: all of them)."""
    if n == 1 or t.ndim == 0:
        return t.numel()
    rows = t.shape[0]
    return math.ceil(rows / n) * (t.numel() // rows if rows else 0)


def held_bytes(ts, n: int, size: int | None = None) -> int:
    """Bytes of the distinct tensors `ts` on one rank of n, in their own element size or `size` bytes each."""
    unique = {id(t): t for t in ts}.values()
    return sum(held(t, n) * (size or t.element_size()) for t in unique)


def _compute_size(p: torch.Tensor, cfg: Config, dtype_size: int) -> int:
    """Bytes per element of p's whole copy in a forward: a full fine-tuning's weights are cast to the model dtype; a
    LoRA's keep their own (the base in the model dtype, the adapter fp32)."""
    return dtype_size if not cfg.model.lora else p.element_size()


def gather(transformer, cfg: Config, dtype: torch.dtype) -> tuple[int, int, str]:
    """(bytes a forward gathers, bytes a backward adds, the words for the phase names) on one actor rank."""
    from gerl.engine.parallel import transformer_blocks

    kind = layout(cfg)
    if kind == "plain":
        return 0, 0, ""
    size = torch.empty((), dtype=dtype).element_size()
    blocks = transformer_blocks(transformer)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in transformer.parameters() if id(p) not in in_blocks]

    def whole(ps) -> int:
        return sum(p.numel() * _compute_size(p, cfg, size) for p in {id(p): p for p in ps}.values())

    def grads(ps) -> int:  # a block's gradients in the compute dtype (bf16/fp16 weights) + the fp32 reduce buffer
        trained = [p for p in ps if p.requires_grad]
        low = 0 if cfg.model.lora or size == 4 else size
        return sum(p.numel() * (low + 4) for p in trained)

    largest = max(blocks, key=lambda b: whole(b.parameters()))
    backward = max(grads(b.parameters()) for b in blocks)
    if kind == "replicas":
        return 0, backward, "+ the largest block's gradient all-reduce"
    forward = whole(root) + 2 * whole(largest.parameters())
    return forward, backward, "+ FSDP2's gathered weights (root + 2 blocks)"


# Phases that run no transformer forward on an actor or hybrid host: nothing is gathered for them.
NO_TRANSFORMER = ("text encoders", "VAE decode", "validation text encoders", "validation VAE decode", "clip + AdamW")


def add_gather(phases: list, forward: int, backward: int, words: str) -> None:
    """Add the layer's gathers to the phases of an actor or hybrid host, in place: a training phase gets the forward's
    and the backward's, any other transformer forward (no grad: recomputes, the anchor's, a hybrid host's generation)
    the forward's; each such phase says so in its name."""
    from gerl.plan.work import GIB

    for p in phases:
        if p.name.startswith(NO_TRANSFORMER):
            continue
        extra = forward + (backward if p.name.startswith("training") else 0)
        if extra:
            p.base_gib += extra / GIB
            p.name += f" {words}"
