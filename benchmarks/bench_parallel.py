"""What the data-parallel engines cost on CPU: 2 hybrid Ray hosts (1 core each, gloo), FSDP2 shards against FSDP2
replicas (DDP), per training step, for full fine-tuning of the tiny FLUX.1 and a LoRA on the tiny SD3.

Each layout trains `--steps` steps (the first, which builds the engine lazily, is left out) with every host's
collectives on gloo over loopback; printed per layout: the actor's update seconds (`train_s`, the slower rank's
wall time as the driver sees it: every rank waits for the others in each collective) and the whole step
(`step_s`), medians, and the actor's peak RSS.

    python -m benchmarks parallel [--steps 6] [key=value ...]
"""

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from gerl.config import load_config
from gerl.logging.quiet import quiet_libraries
from gerl.trainer import train

REPO = Path(__file__).resolve().parents[1]
COMMON = ["engine.kind=ray", "engine.hybrid=true", "engine.device=cpu", "engine.cpus_per_worker=1",
          "engine.actor_workers=2", "engine.rollout_workers=2", "data.prompts_per_step=2", "data.group_size=4",
          "sampling.micro_batch_size=4", "train.mini_batch_size=8", "train.micro_batch_size=2", "validation.every=-1",
          "log.tensorboard=false", "log.progress_bar=false", "log.images_every=0", "checkpoint.every=0"]
MODELS = {"flux-full": ["model.path=tiny-flux", "model.lora=false", "sampling.guidance_scale=3.5"],
          "sd3-lora": ["model.path=tiny"]}
ENGINES = {"replicate": ["engine.fsdp=false"], "fsdp": ["engine.fsdp=true"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    quiet_libraries()
    root = Path(tempfile.mkdtemp(prefix="bench_parallel_"))
    out = {}
    try:
        for model, m in MODELS.items():
            for engine, e in ENGINES.items():
                d = root / f"{model}-{engine}"
                train(load_config(str(REPO / "recipes/tiny_cpu.yaml"), [
                    f"output_dir={d}", f"max_steps={args.steps}", *COMMON, *m, *e, *args.overrides]))
                rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()][1:]
                out[f"{model} {engine}"] = {k: round(statistics.median(r[k] for r in rows), 3)
                                            for k in ("train_s", "step_s", "actor_peak_mem_gib")}
                print(model, engine, out[f"{model} {engine}"], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"steps": args.steps, "layout": "2 hybrid hosts x 1 core, gloo", "medians": out}, indent=1))


if __name__ == "__main__":
    main()
