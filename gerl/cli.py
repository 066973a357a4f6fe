"""`gerl train | prepare | plan | sample | eval | score | report`. Bad input → one line on stderr and exit code 2 (a traceback only with --debug)."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from gerl.errors import Interrupted, RunAborted, UserError
from gerl.logging.quiet import quiet_libraries

# Before torch loads OpenMP: idle threads sleep instead of spinning. On a busy CPU a spinning thread holds a core that
# another thread (the reward, a second worker) needs; measured on 2 shared cores, a 2-thread training step of ocr-mini
# took 6-15 s spinning vs 0.5-1 s passive (docs/lab_notebook.md). Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cmd_train(args) -> int:
    from gerl.config import load_config

    cfg = load_config(args.config, args.overrides)  # before the heavy imports: a bad config fails in milliseconds
    if args.print_config:
        print(resolved_config_yaml(cfg), end="")
        return 0
    quiet_libraries()
    from gerl.trainer import train

    # `kill PID` (SIGTERM) unwinds like Ctrl-C while loading, so cleanup (a Ray this run started) still runs;
    # during training the trainer takes both signals over and stops at the next step boundary.
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    try:
        run_dir = train(cfg)
    except Interrupted as e:
        if e.checkpoint is None:
            print("gerl: interrupted before any step was trained; nothing to resume", file=sys.stderr)
        else:
            again = [a for a in args.overrides if not a.startswith("resume=")] + ["resume=true"]
            cmd = " ".join(shlex.quote(a) for a in ["gerl", "train", args.config, *again])
            print(f"gerl: interrupted after step {e.step}; checkpoint saved to {e.checkpoint}\n"
                  f"gerl: resume with: {cmd}", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
    from gerl.engine.launcher import rank

    if rank() == 0:  # torchrun: the process that wrote it
        print(f"gerl: run written to {run_dir}  (metrics.jsonl, tensorboard/, samples/, checkpoints/)")
    return 0


def cmd_prepare(args) -> int:
    from gerl.config import load_config

    from gerl.engine.rehearse import adapt

    cfg = adapt(load_config(args.config, args.overrides))  # the config `gerl train` will run (a rehearsal's too)
    quiet_libraries()
    from gerl.models.text_cache import prepare

    d, n, gib = prepare(cfg)
    print(f"gerl: {n} prompts' text embeddings written to {d}; runs with model.text_cache={d} load no text encoder "
          f"on their rollout hosts ({gib:.3g} GiB of {cfg.model.dtype} weights)")
    return 0


def cmd_plan(args) -> int:
    from gerl.config import load_config

    cfg = load_config(args.config, args.overrides)  # the same config tree and overrides as `gerl train`
    quiet_libraries()
    from gerl.plan import format_plan, plan_for_config

    plan = plan_for_config(cfg, card=f"{args.card} GB")
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan).rstrip("\n"))
    if cfg.algo.name == "dgpo":  # (the per-algorithm planner is not in yet)
        print("gerl plan: algo.name=dgpo is not modelled yet: the training phase above is Flow-GRPO's replay (one "
              "forward with grad per micro-batch); DGPO's adds two no-grad forwards per point (anchor, base) and may "
              "add a no-grad pass when a micro-batch splits a group", file=sys.stderr)
    return 0


def resolved_config_yaml(cfg) -> str:
    """The config as `train` would run it (defaults, preset and overrides applied; secrets redacted), followed by
    the derived batch arithmetic as YAML comments."""
    from gerl.config import derived_sizes, to_yaml, trained_steps_per_sample

    sizes = derived_sizes(cfg, trained_steps_per_sample(cfg))
    return to_yaml(cfg) + "".join(f"# derived: {k} = {v}\n" for k, v in sizes.items())


# Flags of sample/eval that default to a run's config.yaml (when --lora is one of its checkpoints), else to the
# config tree's defaults: (argparse dest, dotted config key).
RUN_SETTINGS = [("model", "model.path"), ("tiny_seed", "model.tiny_seed"), ("resolution", "model.resolution"),
                ("max_sequence_length", "model.max_sequence_length"), ("num_steps", "sampling.eval_num_steps"),
                ("guidance", "sampling.eval_guidance_scale")]
# Range of each numeric flag: the config key whose RANGES entry applies, or a Range of its own.
FLAG_RANGES = {"n": None, "images_per_prompt": None, "batch_size": "sampling.micro_batch_size", "resolution": "model.resolution",
               "num_steps": "sampling.eval_num_steps", "guidance": "sampling.eval_guidance_scale",
               "max_sequence_length": "model.max_sequence_length", "seed": "seed", "num_prompts": None}


def _run_config_of(lora: str | None) -> Path | None:
    """RUN/config.yaml when `lora` is RUN/checkpoints/step_N (or a file inside it), else None."""
    if not lora:
        return None
    ckpt = Path(lora) if Path(lora).is_dir() else Path(lora).parent
    cfg = ckpt.parent.parent / "config.yaml"
    return cfg if ckpt.parent.name == "checkpoints" and cfg.is_file() else None


def _resolve_settings(args) -> None:
    """Fill the unset model/sampling flags: from the LoRA's run config.yaml if there is one, else the defaults in
    gerl/config.py. A flag given on the command line always wins. Then check every numeric flag's range."""
    import dataclasses

    import yaml

    from gerl.config import RANGES, Config, Range

    def get(tree, dotted):
        for k in dotted.split("."):
            tree = getattr(tree, k) if dataclasses.is_dataclass(tree) else (tree or {}).get(k)
        return tree

    run_cfg_path = _run_config_of(args.lora)
    run_cfg = {}
    if run_cfg_path is not None:
        try:
            run_cfg = yaml.safe_load(run_cfg_path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"cannot read {run_cfg_path} ({str(e).splitlines()[0]}); fix it or pass --model, "
                            "--resolution, ... explicitly") from None
    taken, shipped_taken = [], []
    for dest, key in RUN_SETTINGS:
        if getattr(args, dest, None) is not None:
            continue
        value = get(run_cfg, key) if isinstance(run_cfg, dict) else None
        if value is not None:
            taken.append(f"{key}={value}")
        setattr(args, dest, value if value is not None else None)
    # A shipped model's own settings (what its recipes train and validate with), so that `gerl eval --model ocr-mini`
    # samples exactly as `gerl eval --lora <a run on it>` does; then the config tree's defaults.
    from gerl.models.loader import shipped_settings

    shipped = shipped_settings(args.model or get(run_cfg, "model.path") or "")
    for dest, key in RUN_SETTINGS:
        if getattr(args, dest) is None and dest in shipped:
            setattr(args, dest, shipped[dest])
            shipped_taken.append(f"{key}={shipped[dest]}")
        elif getattr(args, dest) is None:
            setattr(args, dest, get(Config(), key))
    if taken:
        print(f"gerl: from {run_cfg_path}: {', '.join(taken)} (flags override)", file=sys.stderr)
    if shipped_taken:
        print(f"gerl: the shipped model's settings: {', '.join(shipped_taken)} (flags override)", file=sys.stderr)
    for dest, key in FLAG_RANGES.items():
        if not hasattr(args, dest):
            continue
        rng = RANGES[key] if key else Range(lo=1 if dest in ("n", "images_per_prompt") else 0)
        value = getattr(args, dest)
        if not rng.ok(value):
            raise UserError(f"--{dest.replace('_', '-')} {value} must be {rng.text()}" + (f" ({rng.why})" if rng.why else ""))
    if args.resolution % 16:
        raise UserError(f"--resolution {args.resolution} must be a multiple of 16")


def _check_resolution(args, metadata: list[dict] | None = None) -> None:
    """--resolution against what the model can generate: reads its configs (imports diffusers and transformers, and
    builds the tiny model), so it comes after the checks that need none of that. With the prompts' metadata, also
    whether they carry the conditioning images the model's family takes (an editing model needs one per prompt)."""
    from gerl.models.family import check_conditioning
    from gerl.models.loader import model_family
    from gerl.plan.arch import check_resolution

    quiet_libraries()
    family = model_family(args.model)  # a directory gerl cannot train (another pipeline class, a broken model_index)
    if family is not None and metadata is not None:
        check_conditioning(family, metadata, args.prompts or "--prompt")
    check_resolution(args.model, args.resolution, f"--resolution {args.resolution}", args.tiny_seed or 0)


def _json_object(text: str, flag: str) -> dict:
    """A --kwargs style flag: "" → {}, else a JSON object, or a UserError showing the expected form."""
    if not text:
        return {}
    example = f"{flag} '{{\"rec_only\": true}}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} is not valid JSON ({e.msg}); write a JSON object, e.g. {example}") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} must be a JSON object of keyword arguments, got {type(value).__name__}; e.g. {example}")
    return value


def _call_reward(name: str, fn, images, prompts, metadata):
    """call_reward, with an exception the reward raised turned into one line (its traceback with --debug)."""
    from rewards.registry import call_reward

    try:
        return call_reward(fn, images, prompts, metadata)
    except UserError:
        raise
    except Exception as e:
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise UserError(f"reward {name!r} raised {type(e).__name__}: {msg}; fix the reward "
                        "(gerl --debug ... shows the traceback)") from e


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _json_safe(v):
    """JSON has no NaN/inf: write them as null (a reward's non-finite score is "no score")."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _pipeline_for(args):
    quiet_libraries()
    from gerl.config import SamplingConfig
    from gerl.models.loader import TextEmbedder, load_lora_into_pipeline, load_pipeline, lora_file
    from gerl.workers.rollout import RolloutWorker

    if args.lora:
        lora_file(args.lora)  # fail on a bad path before loading the model
    pipe = load_pipeline(args.model, args.dtype, args.device, args.tiny_seed, vae_dtype=args.vae_dtype)
    if args.lora:
        load_lora_into_pipeline(pipe, args.lora)
    sampling = SamplingConfig(micro_batch_size=args.batch_size)
    embedder = TextEmbedder(pipe, args.max_sequence_length, condition_resolution=args.condition_resolution)
    return RolloutWorker(pipe, embedder, sampling, args.resolution, args.seed)


def _read_prompts(args) -> tuple[list[str], list[dict]]:
    from gerl.data.prompts import load_prompts

    texts, meta = list(args.prompt or []), [{} for _ in args.prompt or []]
    if args.prompts:
        loaded = load_prompts(args.prompts)[: args.num_prompts or None]
        texts += [p.text for p in loaded]
        meta += [dict(p.metadata) for p in loaded]
    if not texts:
        raise UserError("no prompts given; pass --prompt TEXT (repeatable) or --prompts FILE")
    return texts, meta


def cmd_sample(args) -> int:
    from gerl.logging.images import image_grid
    from gerl.paths import check_writable

    _resolve_settings(args)
    texts, meta = _read_prompts(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    check_writable(out, f"--out {out}")
    _check_resolution(args, meta)
    from gerl.data.prompts import condition_images

    worker = _pipeline_for(args)
    prompts = [t for t in texts for _ in range(args.n)]
    images = worker.sample_images(prompts, args.seed, args.num_steps, args.guidance,
                                  images=condition_images([m for m in meta for _ in range(args.n)]))
    out.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        im.save(out / f"{i:04d}.png")
    image_grid(images, cols=args.n if args.n > 1 else None).save(out / "grid.png")
    print(f"gerl: wrote {len(images)} images and grid.png to {out}")
    return 0


def mean_and_stderr(scores: list, per_prompt: int) -> dict:
    """Mean of the valid scores and its standard error, counting each prompt as one observation (its images share the
    prompt, so they are not independent): stderr = std(prompt means) / √(prompts). `scores` lists prompt i's images
    at i·per_prompt … (i+1)·per_prompt − 1; None/NaN are left out (a prompt with none is dropped)."""
    means = []
    for i in range(0, len(scores), per_prompt):
        ok = [s for s in scores[i:i + per_prompt] if s is not None and math.isfinite(s)]
        if ok:
            means.append(sum(ok) / len(ok))
    if not means:
        return {"mean": None, "stderr": None, "prompts_scored": 0}
    m = sum(means) / len(means)
    var = sum((x - m) ** 2 for x in means) / (len(means) - 1) if len(means) > 1 else float("nan")
    return {"mean": m, "stderr": math.sqrt(var / len(means)) if len(means) > 1 else None, "prompts_scored": len(means)}


def paired_gain(base: list, lora: list, per_prompt: int) -> dict:
    """LoRA − base per prompt (the same prompts and noise), its mean and standard error over prompts."""
    diffs = []
    for i in range(0, len(base), per_prompt):
        pairs = [(b, t) for b, t in zip(base[i:i + per_prompt], lora[i:i + per_prompt])
                 if b is not None and t is not None and math.isfinite(b) and math.isfinite(t)]
        if pairs:
            diffs.append(sum(t - b for b, t in pairs) / len(pairs))
    return mean_and_stderr(diffs, 1)


def cmd_eval(args) -> int:
    from rewards.registry import build_reward, validate_reward_inputs

    from gerl.paths import check_writable

    _resolve_settings(args)
    if args.with_base and not args.lora:
        raise UserError("--with-base compares a LoRA with its base model: pass --lora CHECKPOINT too")
    if args.lora:
        from gerl.models.loader import lora_file

        lora_file(args.lora)  # a bad path fails before the model loads
    texts, meta = _read_prompts(args)
    k = args.images_per_prompt
    prompts, metas = [t for t in texts for _ in range(k)], [m for m in meta for _ in range(k)]
    kwargs = _json_object(args.reward_kwargs, "--reward-kwargs")
    if args.out:
        if Path(args.out).is_dir():
            raise UserError(f"--out {args.out} is a directory; pass a .json file path")
        check_writable(Path(args.out).parent, f"--out {args.out}")
    fn = build_reward(args.reward, kwargs)
    validate_reward_inputs(fn, texts, meta)
    _check_resolution(args, meta)
    sampler = (f"{args.num_steps} ODE steps, guidance {args.guidance:g}, {args.resolution} px, "
               f"{args.max_sequence_length} T5 tokens, noise seed {args.seed}, {k} image(s) per prompt")
    print(f"gerl: eval sampler: {sampler}" + (" — the same for the base and the LoRA" if args.with_base else ""),
          file=sys.stderr)
    lora, args.lora = args.lora, (None if args.with_base else args.lora)
    worker = _pipeline_for(args)  # the base first when comparing, then its LoRA on the same pipeline

    from gerl.data.prompts import condition_images, with_source_images

    def score() -> list:
        images = worker.sample_images(prompts, args.seed, args.num_steps, args.guidance,
                                      images=condition_images(metas))
        return _call_reward(args.reward, fn, images, prompts, with_source_images(metas))[0]

    result = {"reward": args.reward, "lora": lora, "num_prompts": len(texts), "images_per_prompt": k,
              "sampler": {"num_steps": args.num_steps, "guidance": args.guidance, "resolution": args.resolution,
                          "max_sequence_length": args.max_sequence_length, "seed": args.seed}}
    base_scores = None
    if args.with_base:
        from gerl.models.loader import load_lora_into_pipeline

        base_scores = score()
        load_lora_into_pipeline(worker.pipe, lora)
    scores = score()
    stats = mean_and_stderr(scores, k)
    result.update(mean=stats["mean"], stderr=stats["stderr"], scored=sum(s is not None and math.isfinite(s)
                                                                           for s in scores))
    if base_scores is not None:
        result["base"] = mean_and_stderr(base_scores, k)
        result["gain"] = paired_gain(base_scores, scores, k)
    result["scores"] = [{"prompt": t, "score": s} for t, s in zip(prompts, scores)]
    if base_scores is not None:
        result["base_scores"] = [{"prompt": t, "score": s} for t, s in zip(prompts, base_scores)]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(_json_safe(result), indent=1, allow_nan=False))
    print(json.dumps(_json_safe({k_: v for k_, v in result.items() if not k_.endswith("scores")}), allow_nan=False))
    return 0


def cmd_score(args) -> int:
    from PIL import Image

    from rewards.registry import build_reward, validate_reward_inputs

    images = []
    for path in args.images:
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read image {path} ({e}); pass PNG/JPEG files") from None
    if args.prompts:
        from gerl.data.prompts import load_prompts

        loaded = load_prompts(args.prompts)
        if len(loaded) < len(images):
            raise UserError(f"{args.prompts} has {len(loaded)} prompts for {len(images)} images; give one per image")
        prompts, metadata = [p.text for p in loaded[: len(images)]], [dict(p.metadata) for p in loaded[: len(images)]]
    else:
        prompts, metadata = [args.prompt or ""] * len(images), [{} for _ in images]
    kwargs = _json_object(args.kwargs, "--kwargs")
    fn = build_reward(args.reward, kwargs)
    validate_reward_inputs(fn, prompts, metadata)
    from gerl.data.prompts import with_source_images

    scores, extras = _call_reward(args.reward, fn, images, prompts, with_source_images(metadata))
    rows = [{"image": path, "prompt": p, "score": s, **{k: v[i] for k, v in extras.items()}}
            for i, (path, p, s) in enumerate(zip(args.images, prompts, scores))]
    print(json.dumps(_json_safe(rows), indent=1, default=str, allow_nan=False))
    return 0


def cmd_report(args) -> int:
    from gerl.logging.report import write_report
    from gerl.paths import check_writable

    if args.out:
        out = Path(args.out)
        check_writable(out if out.is_dir() else out.parent, f"--out {out}")
    out = write_report([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    print(f"gerl: report written to {out}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    run = " (default: the LoRA's run config.yaml, else %s)"
    p.add_argument("--model", default=None, help="'tiny' (or tiny-flux, tiny-flux-schnell, tiny-qwenimage, tiny-flux-kontext, "
                   "tiny-qwenimage-edit, tiny-flux2-klein, tiny-zimage), 'ocr-mini', "
                   "a local diffusers directory (SD3/SD3.5, FLUX.1 or Qwen-Image), or a hub id" + run % "tiny")
    p.add_argument("--lora", default=None, help="a checkpoint directory or .safetensors LoRA; a checkpoint of a run "
                   "directory also supplies model, resolution, sequence length, steps and guidance")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help="a .txt or .jsonl prompt file (an editing model's lines: "
                   '{"prompt": ..., "image": PATH relative to the file})')
    p.add_argument("--condition-resolution", type=int, default=0,
                   help="image editing: the conditioning image's area as a side in pixels (0 = the stock pipeline's)")
    p.add_argument("--num-prompts", type=int, default=0, help="use the first N prompts of --prompts (0 = all)")
    p.add_argument("--num-steps", type=int, default=None, help="ODE denoising steps" + run % "40")
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale" + run % "1.0")
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels" + run % "64")
    p.add_argument("--max-sequence-length", type=int, default=None, help="T5 tokens, SD3.5: 256" + run % "32")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--vae-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the VAE's decode: auto = bf16 on CUDA, fp32 on a CPU (model.vae_dtype)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gerl")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse with gerl's bad-input rule: no abbreviated flags (`--res` is not `--resolution`), and an error is one
    line (`gerl: error: ...`, exit 2) naming the closest flag when one was mistyped, with the usage folded in."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.argv: list[str] = []

    def _chosen(self) -> argparse.ArgumentParser:
        """The subcommand's parser once argv names one (unknown flags are reported by the top parser), else self."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = next((a for a in self.argv if a in action.choices), None)
                if chosen is not None:
                    return action.choices[chosen]
        return self

    def error(self, message: str):
        where, hints = self._chosen(), []
        if message.startswith("unrecognized arguments:"):
            flags = [s for p in {id(self): self, id(where): where}.values() for a in p._actions for s in a.option_strings]
            for word in message.split(":", 1)[1].split():
                if word.startswith("-"):
                    close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.5)
                    hints.append(f"did you mean {close[0]} for {word}?" if close else f"{where.prog} has no flag {word}")
        elif "invalid choice:" in message:
            word = message.split("invalid choice:", 1)[1].split("(")[0].strip(" '")
            choices = [c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
            close = difflib.get_close_matches(word, choices, n=1)
            hints += [f"did you mean {close[0]}?"] if close else []
        usage = " ".join(where.format_usage().split())
        self.exit(2, f"gerl: error: {where.prog}: {message}{'; ' + '; '.join(hints) if hints else ''} ({usage}; "
                     f"{where.prog} --help explains each flag)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="gerl", description="Flow-GRPO post-training for SD3")
    parser.argv = list(argv or [])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("--version", action="version", version=f"gerl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with a YAML config and dotted key=value overrides")
    t.add_argument("config", metavar="CONFIG.yaml", help="a recipe such as recipes/tiny_cpu.yaml")
    t.add_argument("overrides", nargs="*", default=[], metavar="key=value",  # a default makes argparse call it optional
                   help="optional dotted overrides, e.g. train.learning_rate=3e-4 output_dir=runs/x")
    t.add_argument("--print-config", action="store_true",
                   help="print the fully resolved config as YAML and exit, writing nothing")
    t.set_defaults(fn=cmd_train)
    pr = sub.add_parser("prepare", help="encode every training and validation prompt once into model.text_cache "
                        "(memory-mapped), so that the run's rollout hosts load no text encoder")
    pr.add_argument("config", metavar="CONFIG.yaml", help="the config the run will use")
    pr.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                    help="optional dotted overrides, as for train, e.g. model.text_cache=data/text_cache")
    pr.set_defaults(fn=cmd_prepare)
    pl = sub.add_parser("plan", help="predicted peak GPU memory per role, the cards it fits and the largest "
                        "micro-batches, from a config alone (no GPU, no weights; docs/plan.md)")
    pl.add_argument("config", metavar="CONFIG.yaml", help="a recipe such as recipes/gerl_sd3_fast_ocr.yaml")
    pl.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                    help="optional dotted overrides, as for train, e.g. engine.hybrid=false train.micro_batch_size=4")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    pl.add_argument("--card", choices=["24", "40", "48", "80", "141"], default="80",
                    help="the card size in GB that a configuration must fit on one device; when it does not, the "
                    "plan names the smallest changes that do (default: 80)")
    pl.set_defaults(fn=cmd_plan)
    s = sub.add_parser("sample", help="generate images from the base model or a LoRA")
    _model_args(s)
    s.add_argument("--n", type=int, default=1, help="images per prompt")
    s.add_argument("--out", required=True, help="output directory")
    s.set_defaults(fn=cmd_sample)
    e = sub.add_parser("eval", help="score the base model or a LoRA on a prompt set with a reward")
    _model_args(e)
    e.add_argument("--reward", required=True, help="registered reward name or module:callable")
    e.add_argument("--reward-kwargs", default="", help="JSON object of reward factory arguments")
    e.add_argument("--out", default=None, help="write per-prompt scores as JSON here")
    e.add_argument("--images-per-prompt", type=int, default=1,
                   help="images per prompt, each with its own noise; the mean's standard error is over prompts")
    e.add_argument("--with-base", action="store_true",
                   help="also score the LoRA's base model with the same prompts, noise and sampler, and report the "
                        "gain (LoRA − base) with its paired standard error")
    e.set_defaults(fn=cmd_eval)
    c = sub.add_parser("score", help="score image files with a reward (check a custom reward before training)")
    c.add_argument("reward", help="registered reward name, entry point, or module:callable")
    c.add_argument("images", nargs="+", help="image files")
    c.add_argument("--prompt", default=None, help="the prompt for every image")
    c.add_argument("--prompts", default=None, help="a .txt/.jsonl file: line i is image i's prompt")
    c.add_argument("--kwargs", default="", help="JSON object of reward factory arguments")
    c.set_defaults(fn=cmd_score)
    r = sub.add_parser("report", help="HTML + PNG report of one or more runs (curves, seed table, timeline)")
    r.add_argument("runs", nargs="+", help="run directories")
    r.add_argument("--out", default=None, help="output .html path (default: RUN_DIR/report.html for one run)")
    r.set_defaults(fn=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    print_config = "--print-config" in argv  # taken out first so it may sit anywhere among the key=value overrides
    if print_config:
        argv.remove("--print-config")
    args = build_parser(argv).parse_args(argv)
    if print_config and args.command != "train":
        print("gerl: error: --print-config only applies to `gerl train`", file=sys.stderr)
        return 2
    if args.command == "train":
        args.print_config = print_config
    try:
        return args.fn(args)
    except UserError as e:
        if debug:
            raise
        print(f"gerl: error: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:
        if debug:
            raise
        print(f"gerl: run aborted: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("gerl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
