"""gerl plan's data-parallel lines (gerl/plan/shard.py) against the CPU allocator on 3 gloo ranks, and its smallest
change that fits answering engine.fsdp=true with N GPUs.

What a rank of engine.fsdp=true holds after a real update — the tiny FLUX transformer built, sharded by the layer
itself (gerl/engine/parallel.py), a training forward and backward, an AdamW step — is measured as the allocator's net
bytes (tests/plan_allocator.py) on rank 0 (the largest third: FSDP2 rounds every dim-0 split up) and compared with the
plan's resident lines for that rank: the fp32 master shards of bf16 full fine-tuning (or a bf16 base's shards and the
fp32 adapter's), their gradients and AdamW moments — to the byte, but for AdamW's step counters."""

import functools
import gc

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gerl.config import load_config
from gerl.plan import plan_for_config
from gerl.plan.fit import need_gib, smallest_changes
from tests.plan_allocator import net_bytes
from tests.train.helpers import REPO

TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
# decoupled, every micro-batch at its least and checkpointing on: only the resident lines are left to change
BASE = ["model.path=tiny-flux", "model.dtype=bf16", "engine.kind=ray", "engine.device=cuda", "engine.hybrid=false",
        "train.micro_batch_size=1", "sampling.micro_batch_size=1", "model.gradient_checkpointing=true"]
CASES = {"full": ["model.lora=false", "train.ema_decay=0.9"], "lora": ["model.lora=true", "model.lora_rank=4",
                                                                      "model.lora_targets=[]"]}
WORLD = 3  # tiny FLUX's dims (16, 32, 64, …) split unevenly over 3 ranks: FSDP2's padding shows
SHARDED = ["engine.fsdp=true", f"engine.actor_workers={WORLD}", "data.prompts_per_step=3", "data.group_size=2",
           "train.mini_batch_size=6"]


@functools.cache
def _plan(case: str, sharded: bool):
    return plan_for_config(load_config(TINY, [*BASE, *CASES[case], *(SHARDED if sharded else [])]), card=None)


MAX_UPDATES = 12  # per case: see _rank
SLACK = 64  # bytes the allocator may hold beyond the plan's lines and AdamW's step counters


def _planned(case: str) -> int:
    """Bytes of the plan's shard lines of one actor rank: its weights (or masters), adapter, gradients, AdamW."""
    lines = {i.name: i.gib * 2**30 for i in _plan(case, True).role("actor").resident}
    shards = [k for k in lines if k.startswith(("transformer weights", "LoRA adapter", "gradients", "AdamW"))]
    assert len(shards) == (4 if case == "lora" else 3) and all(f"FSDP2 shard 1/{WORLD}" in k for k in shards), shards
    return round(sum(lines[k] for k in shards))


def _rank(rank: int, store: str, out: str, planned: dict[str, int]) -> None:
    from gerl.engine.parallel import parallelize
    from gerl.models.loader import add_lora, load_pipeline
    from tests.engine.test_parallel import _inputs

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        held, kept = {}, []
        for case in CASES:
            lora = case == "lora"

            def update():  # from the model's build on: the allocator reports no frees of older storage
                tr = load_pipeline("tiny-flux", "bf16", "cpu", 0, ("transformer",)).transformer
                if lora:
                    add_lora(tr, 4, 8.0, [], seed=0)
                else:
                    tr.requires_grad_(True)
                parallelize(tr, None, group=dist.group.WORLD, shard=True, dtype=torch.bfloat16, lora=lora)
                params = [p for p in tr.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
                out = tr(**_inputs(tr, slice(0, 2), torch.bfloat16), return_dict=False)[0]
                out.float().square().mean().backward()
                opt.step()  # the gradients stay, as between the micro-batches of a mini-batch
                kept.append((tr, opt))
                held[f"{case} steps"] = len(opt.state)
                gc.collect()  # the rest of the pipeline the model was built in, held in reference cycles

            if not held:  # once before: what the first update in a process sets up once (torch's caches)
                net_bytes(update)
            # A storage whose last reference a gloo thread drops is freed where the profiler does not look, and then
            # counts as held: +4 to +300 KiB, in 20 of 34 updates of the full case and 12 of 44 of the LoRA case
            # (2026-11-28; profile_all_threads records no memory events at all). That noise only ever adds, so the
            # ranks update again, all of them (the collectives), until rank 0 measures at most SLACK over the plan —
            # or under it, which no noise explains: the test fails on it — up to MAX_UPDATES times.
            held[f"{case} all"] = []
            while True:
                held[f"{case} all"].append(net_bytes(update))
                extra = held[f"{case} all"][-1] - planned[case] - 4 * held[f"{case} steps"]
                done = torch.tensor([extra <= SLACK or len(held[f"{case} all"]) == MAX_UPDATES])
                dist.broadcast(done, 0)
                if done.item():
                    break
            held[case] = held[f"{case} all"][-1]
        if rank == 0:
            torch.save(held, out)
    finally:
        dist.destroy_process_group()


def test_a_ranks_shards_match_the_cpu_allocator(tmp_path):
    out = tmp_path / "rank0.pt"
    planned = {case: _planned(case) for case in CASES}
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(out), planned), nprocs=WORLD, start_method="fork")
    held = torch.load(out)
    for case in CASES:
        # + AdamW's step counters (a 0-d fp32 tensor per parameter, on the CPU on a GPU run too) and a few bytes
        extra = held[case] - planned[case] - 4 * held[f"{case} steps"]
        assert 0 <= extra <= SLACK, (case, held[f"{case} all"], planned[case], extra)


def test_the_smallest_change_that_fits_can_be_sharding_over_n_gpus():
    """A decoupled bf16 full fine-tuning whose actor fits no card of the size tried, with no smaller micro-batch or
    checkpointing left to help: the plan answers engine.fsdp=true with 2 actor GPUs, the smallest N whose
    re-planned actor fits, and stops searching there."""
    cfg = load_config(TINY, [*BASE, *CASES["full"]])
    one = _plan("full", False)
    two = plan_for_config(load_config(TINY, [*BASE, *CASES["full"], "engine.fsdp=true", "engine.actor_workers=2"]),
                          card=None)
    need = {n: need_gib(max(r.peak_gib for r in p.roles)) for n, p in ((1, one), (2, two))}
    assert need[2] < need[1]
    replanned = []

    def replan(other):
        replanned.append(other.engine.actor_workers)
        assert other.engine.fsdp and other.engine.actor_workers == 2
        return two.roles

    fit = smallest_changes(cfg, one.roles, "a card between the two", (need[1] + need[2]) / 2, replan)
    assert not fit.fits and fit.changes, fit.tried
    assert fit.changes[0].overrides == ["engine.fsdp=true", "engine.actor_workers=2"], fit.changes[0]
    assert replanned == [2], "the search stops at the first N that fits"
