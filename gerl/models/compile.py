"""model.compile: regional torch.compile of the transformer's blocks, shared by the rollout and the training replay.

Each block of the family's block lists (`Family.block_lists`: SD3's transformer_blocks; FLUX's double- and
single-stream lists) is compiled in place with `module.compile()` — parameters, state_dict keys, LoRA exports, weight
sync and checkpoints stay exactly as they are — once, where the pipeline is built and after the LoRA adapter is
attached. The rollout (no grad) and the trainer's replay (grad) then call the same compiled modules: on a hybrid host
the same objects, on decoupled hosts the same build. Blocks of one structure share their graphs (dynamo caches
them on the block class's `forward`), so SD3.5-M's 24 blocks compile as 3 graphs (plain, dual-attention, last).

Shapes are static (`dynamic=False`) and every block call is one graph (`fullgraph=True`: a graph break is an error
at the first call, not a silent slow path). What makes a block call a different graph — each compiled once, the
first time it occurs, and never again:
    grad mode         the rollout, validation, old-log-prob recomputation and references run without grad, training
                      with it (and gradient checkpointing's recomputation reuses the training graph);
    batch rows        sampling.micro_batch_size and train.micro_batch_size, doubled by SD3's classifier-free guidance
                      (Family.forward_rows), the validation's last, smaller chunk, and a smaller training micro-batch
                      when failed rewards dropped samples or groups split a mini-batch (nft/awm/dgpo);
    weights           the adapter on, off (the KL reference of a LoRA) or merged (model.merge_lora), or a frozen
                      copy (the reference of full fine-tuning, compiled like the policy).
`variant_bound(cfg)` counts the combinations a config can produce. `compile_transformer` sets dynamo's recompile
limit to (block structures of a class) × that bound, explicitly, and makes reaching it an error: a shape that
changes every call (a bug) stops the run instead of silently falling back to eager blocks, which would break the
"same graph on both sides" that keeps the ratio exact.

`CompileWatch` counts what compiled inside a `with` block (graphs — after warm-up each one a recompilation —, graph
breaks, seconds); the roles log the per-step deltas as rollout_/actor_compile_s and _graphs_compiled (non-zero in the
first step, zero after warm-up), and benchmarks call both functions directly.
"""

from __future__ import annotations

import threading
import time

import torch

from gerl.errors import UserError

# dynamo's timers that together are "time spent compiling": a frame's compilation (tracing, AOT autograd, inductor's
# forward) and the lazy compilation of its backward at the first backward pass
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def blocks_of(transformer, family) -> dict[str, list[torch.nn.Module]]:
    """{block list name: its blocks} of `transformer`, in the family's order."""
    return {name: list(getattr(transformer, name)) for name in family.block_lists if hasattr(transformer, name)}


def block_structures(blocks: list[torch.nn.Module]) -> dict[str, int]:
    """{block class name: how many distinct structures its blocks have}: blocks that print the same (same submodules,
    same shapes, same adapters) trace to the same graph, others to their own (SD3's last block has no text output;
    SD3.5-M's first 13 have a second attention)."""
    seen: dict[str, set[str]] = {}
    for b in blocks:
        seen.setdefault(type(b).__name__, set()).add(repr(b))
    return {k: len(v) for k, v in seen.items()}


def compile_transformer(transformer, family=None, *, variants: int | None = 8, backend: str = "inductor",
                        mode: str | None = None, fullgraph: bool = True, options: dict | None = None) -> dict:
    """Compile every block of `transformer` in place (regional compilation; nothing compiles until the first call).

    Args:
        family: the model family (default: the transformer's own, `family_of`).
        variants: distinct block calls per block structure the caller expects (`variant_bound`); the recompile
            limit becomes structures × variants, and reaching it raises. None leaves dynamo's limits as they are
            (a second module compiled into a process whose limit is already set).
        backend, mode, options: torch.compile's. With inductor, options always include emulate_precision_casts
            (below: what keeps the ratio exact in bf16/fp16), and a mode (e.g. "max-autotune-no-cudagraphs", which
            autotunes the GEMMs) is passed as its options; the modes with CUDA graphs are untested here.
        fullgraph: a graph break raises at the first call (True) or splits the block into pieces (False).

    Returns: {"compiled_blocks", "block_lists": {name: count}, "structures": {class: count}, "recompile_limit",
    "backend", "mode", "fullgraph", "dynamic"} — what the benchmark records.
    """
    if family is None:
        from gerl.models.family import family_of

        family = family_of(transformer)
    if family.compile_refusal:
        raise UserError(f"model.compile=true cannot keep {family.title}'s shapes fixed: {family.compile_refusal}; "
                        "set model.compile=false")
    lists = blocks_of(transformer, family)
    blocks = [b for bl in lists.values() for b in bl]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has none of the block lists {family.block_lists}")
    structures = block_structures(blocks)
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    if variants is not None:
        limit = max(structures.values()) * variants
        dynamo_config.recompile_limit = limit
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit)
        dynamo_config.fail_on_recompile_limit_hit = True
    extra = {"mode": mode} if mode is not None else {}
    if backend == "inductor":  # inductor takes a mode or options, not both: a mode becomes its options
        if mode is not None:
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode), **(options or {})}
        # Round every bf16/fp16 intermediate as eager does. Without it, inductor keeps fused intermediates in fp32
        # where its training graph (which saves them for backward) rounds them: the rollout's no-grad graph and the
        # training graph then disagree — max |ratio − 1| 8.7e-3 in bf16 on the tiny SD3, 4.8e-7 (eager's) with it.
        extra = {"options": {"emulate_precision_casts": True, **(options or {})}}
    elif options is not None:
        extra["options"] = options
    for b in blocks:
        b.compile(backend=backend, fullgraph=fullgraph, dynamic=False, **extra)
    return {"compiled_blocks": len(blocks), "block_lists": {k: len(v) for k, v in lists.items()},
            "structures": structures, "recompile_limit": limit, "backend": getattr(backend, "__name__", backend),
            "mode": mode, "options": extra.get("options"), "fullgraph": fullgraph, "dynamic": False}


def variant_bound(cfg, family) -> int:
    """How many distinct block calls (grad mode × batch rows × weights) a run of `cfg` can make, counted generously:
    every row count any forward can have (the rollout's and validation's micro-batches, every training micro-batch
    size up to train.micro_batch_size, each at every guidance a forward uses), times 2 grad modes, times the weight
    sets (adapter on; off or a frozen reference copy; merged)."""
    s, t, v, a = cfg.sampling, cfg.train, cfg.validation, cfg.algo
    guidances = {s.guidance_scale, s.eval_guidance_scale, 1.0, a.dgpo_reference_guidance}
    sizes = {s.micro_batch_size, *range(1, t.micro_batch_size + 1)}
    val_images = v.num_prompts * v.images_per_prompt
    sizes |= {min(s.micro_batch_size, val_images), val_images % s.micro_batch_size} - {0}
    rows = {family.forward_rows(n, g) for n in sizes for g in guidances}
    weights = 2 + bool(cfg.model.merge_lora)
    return len(rows) * 2 * weights


def compile_totals() -> dict[str, float]:
    """What dynamo has compiled in this process so far: graphs (after warm-up, every new one is a recompilation: a
    shape, grad mode or adapter state not seen before), graph breaks, seconds spent compiling."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "compile_s": sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS)}


class CompileWatch:
    """`with CompileWatch() as w:` … then `w.counts`: the graphs, graph breaks and compile seconds of the block
    (process-wide counters, so a thread compiling meanwhile is counted too), plus its wall seconds."""

    def __enter__(self) -> "CompileWatch":
        self.counts: dict[str, float] = {}
        self._start, self._t0 = compile_totals(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end = compile_totals()
        self.counts = {k: end[k] - self._start[k] for k in end}
        self.counts["wall_s"] = time.perf_counter() - self._t0


_reported = {"graphs": 0, "compile_s": 0.0}  # what take_compile_metrics has handed out in this process
_reported_lock = threading.Lock()  # the streaming schedule's rollout threads and the actor report concurrently


def take_compile_metrics(role: str) -> dict[str, float]:
    """{role}_compile_s and {role}_graphs_compiled since the last call in this process (whichever role called): the
    rollout and the actor of a hybrid host share one process and its counters, and each compile is logged once."""
    with _reported_lock:
        now = compile_totals()
        out = {f"{role}_compile_s": now["compile_s"] - _reported["compile_s"],
               f"{role}_graphs_compiled": int(now["graphs"] - _reported["graphs"])}
        _reported.update(graphs=now["graphs"], compile_s=now["compile_s"])
    return out
