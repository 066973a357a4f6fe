"""The training loop, top to bottom: sample prompts → generate (reward futures per micro-batch) → gather rewards →
advantages → update → sync weights → log / checkpoint / validate.

`prepare` checks everything a user can get wrong *before* anything is written; `Trainer.fit` is the loop. The
engine (gerl/engine) places the roles — in this process, or as Ray actors — and the schedule decides how far
generation runs ahead of training: 0 batches (sync) or up to engine.max_staleness (async; 1 = one-step-off).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from gerl.algo.advantages import PerPromptTracker, compute_advantages
from gerl.checkpoint import find_resume_checkpoint
from gerl.config import Config, derived_sizes, redact, reward_components, to_dict, to_yaml, trained_steps_per_sample
from gerl.data.prompts import Prompt, PromptSampler, load_prompts
from gerl.errors import Interrupted, RunAborted, UserError
from gerl.logging.describe import speed
from gerl.logging.images import image_grid, save_grid_captions
from gerl.logging.metrics import MetricsLogger, read_jsonl
from gerl.logging.throughput import reference_tokens, tracker_for
from gerl.logging.timeline import Timeline, truncate_timeline
from gerl.models.loader import lora_file, model_family
from gerl.paths import check_writable
from gerl.workers.batch import RolloutBatch, subset
from gerl.workers.reward import RewardResult
from rewards.registry import build_reward, validate_reward_inputs


@dataclass
class Prepared:
    train_prompts: list[Prompt]
    test_prompts: list[Prompt]
    reward_fns: list
    resume_from: Path | None
    pipe: object


def _metrics_rows(run_dir: Path) -> int:
    """Steps logged in run_dir/metrics.jsonl (0 if absent: a start that failed before step 1 left no run)."""
    try:
        return sum(1 for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip())
    except OSError:
        return 0


def _check_output_dir(cfg: Config) -> None:
    from gerl.engine.launcher import rank

    out = Path(cfg.output_dir)
    if rank() == 0:  # the process that writes the run directory (torchrun: the others only read it)
        check_writable(out, f"output_dir {out}")
    if out.is_dir() and _metrics_rows(out) and cfg.resume == "false" and not cfg.overwrite:
        raise UserError(f"output_dir {out} already holds a run; pass resume=true to continue it, overwrite=true to "
                        "start over, or choose another output_dir")


def prepare(cfg: Config) -> Prepared:
    """Validate every input and load the model. Raises UserError; writes nothing."""
    train = load_prompts(cfg.data.train_prompts)
    test = load_prompts(cfg.data.test_prompts)[: cfg.validation.num_prompts] if cfg.validation.every >= 0 else []
    if cfg.data.prompts_per_step > len(train):
        raise UserError(f"data.prompts_per_step={cfg.data.prompts_per_step} exceeds the {len(train)} prompts in "
                        f"{cfg.data.train_prompts}; lower it or add prompts")
    # the cheap checks first: a bad path fails before a reward model or a library loads
    _check_output_dir(cfg)
    resume_from = find_resume_checkpoint(Path(cfg.output_dir), cfg.resume)
    if resume_from is not None:  # a damaged line inside the logs fails here, before config.yaml is rewritten
        for log in ("metrics.jsonl", "timeline.jsonl"):
            read_jsonl(Path(cfg.output_dir) / log)
    _check_resume(cfg, resume_from)
    # the model's family from its model_index.json: a directory gerl cannot train fails here, before anything loads
    family = model_family(cfg.model.path)
    if family is not None:  # an editing model's prompts each carry an image; a text-to-image model's none
        from gerl.models.family import check_conditioning

        check_conditioning(family, [p.metadata for p in train], cfg.data.train_prompts)
        check_conditioning(family, [p.metadata for p in test], cfg.data.test_prompts)
    if cfg.model.compile and family is not None and family.compile_refusal:
        raise UserError(f"model.compile=true cannot keep {family.title}'s shapes fixed: {family.compile_refusal}; set "
                        "model.compile=false")
    if cfg.model.text_cache:  # a stale or missing prompt-embedding cache, in one line, before any model loads
        from gerl.models.text_cache import check

        check(cfg)
    if cfg.model.init_lora:
        lora_file(cfg.model.init_lora)
    if cfg.log.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise UserError("log.wandb=true needs wandb: pip install 'gerl[wandb]' (or set log.wandb=false)")
    everything = train + test
    reward_fns = []
    for comp in reward_components(cfg.reward):
        fn = build_reward(comp.name, comp.kwargs)
        validate_reward_inputs(fn, [p.text for p in everything], [p.metadata for p in everything])
        reward_fns.append(fn)
    from gerl.plan.arch import check_resolution

    check_resolution(cfg.model.path, cfg.model.resolution, f"model.resolution={cfg.model.resolution}", cfg.model.tiny_seed)
    # before any model loads: the local engine trains and generates in this process (Ray hosts apply it themselves)
    if cfg.train.deterministic and cfg.engine.kind == "local":
        from gerl import determinism

        determinism.apply(cfg.seed, "driver")
    pipe = None
    if cfg.engine.kind == "local":
        from gerl.engine.roles import build_pipeline

        pipe = build_pipeline(cfg)
    return Prepared(train, test, reward_fns, resume_from, pipe)


def _check_resume(cfg: Config, resume_from: Path | None) -> None:
    """resume=true must not silently start over a run that has metrics, nor 'finish' having trained nothing."""
    out = Path(cfg.output_dir)
    if resume_from is None:
        rows = _metrics_rows(out)
        if cfg.resume == "true" and rows and not cfg.overwrite:
            raise UserError(f"resume=true but {out} has no checkpoint to resume from (metrics.jsonl holds {rows} "
                            "steps); pass overwrite=true (drop resume=true) to start over, or choose another output_dir")
        return
    try:
        step = int(json.loads((resume_from / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # a damaged checkpoint is reported when it is loaded
    if cfg.max_steps <= step:
        raise UserError(f"resume: checkpoint {resume_from} is at step {step} and max_steps={cfg.max_steps}, so there "
                        f"is nothing left to train; raise max_steps above {step} (e.g. max_steps={2 * step})")


class MemoryPlanner:
    """`gerl plan` for a GPU run, computed on a thread while the model loads (FakeTensorMode takes ~15 s of CPU for
    SD3.5-M; dispatch modes are thread-local, so the loading next to it is unaffected). `result()` waits for it."""

    def __init__(self, cfg: Config):
        import threading

        self.plan, self.error = None, None
        # diffusers and transformers import their classes lazily, and two threads resolving the same lazy name at
        # once can fail: resolve here, on the main thread, every class the plan and the loader both touch — the run's
        # family's, or every family's for a hub id not yet in the cache.
        from gerl.models.family import families

        family = model_family(cfg.model.path)
        for f in [family] if family is not None else families().values():
            f.resolve_lazy_classes()
        import peft  # noqa: F401

        import gerl.plan  # noqa: F401
        self._thread = threading.Thread(target=self._run, args=(cfg,), name="gerl-plan", daemon=True)
        self._thread.start()

    def _run(self, cfg: Config) -> None:
        try:
            from gerl.plan import plan_for_config

            self.plan = plan_for_config(cfg)
        except Exception as e:  # noqa: BLE001 — a plan is advice: a model whose configs are not local gets none
            self.error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__

    def result(self, timeout_s: float = 300.0):
        self._thread.join(timeout_s)
        return self.plan


def is_gpu_run(cfg: Config) -> bool:
    """Whether this run trains on GPUs (not a rehearsal): the runs that print their memory plan."""
    from gerl.config import gpu_topology
    from gerl.models.loader import resolve_device

    if cfg.engine.rehearse:
        return False
    if cfg.engine.kind == "ray":
        return gpu_topology(cfg)
    return resolve_device(cfg.model.device).type == "cuda"


class Trainer:
    def __init__(self, cfg: Config, prep: Prepared, planner: MemoryPlanner | None = None):
        self.cfg = cfg
        self.planner = planner
        self.plan_metrics: dict[str, float] = {}  # plan_peak_gib/<role>, logged next to the measured peaks
        self.run_dir = Path(cfg.output_dir)
        self.train_prompts, self.test_prompts = prep.train_prompts, prep.test_prompts
        self.sizes = derived_sizes(cfg, trained_steps_per_sample(cfg))
        if cfg.engine.kind == "local":
            from gerl.engine.local import LocalEngine

            self.engine = LocalEngine(cfg, prep.reward_fns, prep.pipe)
        else:
            from gerl.engine.ray_engine import RayEngine

            self.engine = RayEngine(cfg)
        self.sampler = PromptSampler(self.train_prompts, cfg.data.prompts_per_step, cfg.seed)
        self.sampler_after: dict[int, dict] = {}  # step → sampler position after drawing that step's prompts
        unbiased = cfg.conventions.group_std == "unbiased"
        self.tracker = PerPromptTracker(cfg.train.tracker_buffer, unbiased) if cfg.train.per_prompt_tracker else None
        self.start_step = 0
        self.counters = {k: 0 for k in (
            "nonfinite_reward_steps_skipped", "nonfinite_updates_skipped", "reward_failed_samples_total",
            "reward_retries_total", "reward_timeouts_total", "reward_errors_total", "dropped_samples_total",
            "dropped_groups_total")}
        if prep.resume_from is not None:
            state = self.engine.load(prep.resume_from)
            self.start_step = state["step"]
            self.sampler.load_state_dict(state["sampler"])
            if self.tracker is not None and state.get("tracker"):
                self.tracker.load_state_dict(state["tracker"])
            self.counters.update(state.get("counters", {}))
        self._shown_errors: set[str] = set()  # reward error texts already printed (each distinct one once)
        self._last_error = ""  # the latest reward error text, for the message that stops the run
        self._no_reward_steps = 0  # consecutive steps in which no sample got a valid reward
        self._stop_signal: int | None = None  # SIGINT/SIGTERM received: stop at the next step boundary
        self._first_update_checked = False  # the first update's gradient is checked (first_update_warning)
        self._checkpointed: int | None = None  # the step last checkpointed by this run
        if cfg.engine.schedule == "stream":  # rollouts pull groups from one prompt stream (gerl/engine/stream.py)
            stream_state = state.get("stream") if prep.resume_from is not None else None
            self.sampler_after[(stream_state or {}).get("first_draw", 1) - 1] = self.sampler.state_dict()
            self.engine.open_stream(self.next_prompts, stream_state, cfg.max_steps - self.start_step)
        # torchrun / accelerate launch: every process runs this trainer on the same batch, rank 0 alone writes
        self.writer = getattr(self.engine, "rank", 0) == 0
        if self.writer:
            self._open_run_dir(prep)
        else:
            self.timeline, self.logger = Timeline(None), _NoLogger()
        # Throughput, GPU-hours and MFU; a resumed run replays the metrics.jsonl rows the logger kept.
        self.throughput = tracker_for(cfg, getattr(self.engine, "devices", 1), prep.pipe,
                                      getattr(self.engine, "device_name", None))
        if self.writer:
            self.throughput.restore(self.run_dir / "metrics.jsonl")
        self._step_clock = time.perf_counter()  # run_step measures step_s from here or from the previous step end

    def _open_run_dir(self, prep: Prepared) -> None:
        """Create the run directory: config.yaml, placement.json, samples/, timeline and metrics logs."""
        cfg = self.cfg
        existed = self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / "config.yaml.tmp"
            tmp.write_text(to_yaml(cfg))
            tmp.replace(self.run_dir / "config.yaml")
            # what runs where: host, roles, node, GPU ids, device, dtype, process-group backends
            placement = getattr(self.engine, "placement", None)
            if placement:
                (self.run_dir / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
            (self.run_dir / "samples").mkdir(exist_ok=True)
            resume_step = self.start_step if prep.resume_from is not None else None
            self.timeline = Timeline(self.run_dir / "timeline.jsonl")
            truncate_timeline(self.run_dir, resume_step)
            self.logger = MetricsLogger(self.run_dir, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
                                        redact(to_dict(cfg)), resume_step, wandb_name=cfg.log.wandb_name,
                                        wandb_id=cfg.log.wandb_id, wandb_tags=cfg.log.wandb_tags)
        except BaseException:
            # A failed start leaves nothing behind that a rerun would refuse (or the Ray it started running).
            self.engine.close()
            if not existed:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ stages
    def next_prompts(self, step: int) -> tuple[list[str], list[dict], torch.Tensor]:
        n = self.cfg.data.group_size
        chosen = self.sampler.next_prompts()
        self.sampler_after[step] = self.sampler.state_dict()
        prompts = [p.text for p in chosen for _ in range(n)]
        metadata = [dict(p.metadata) for p in chosen for _ in range(n)]
        group_ids = torch.arange(len(chosen)).repeat_interleave(n)
        return prompts, metadata, group_ids

    def apply_failure_policy(self, batch: RolloutBatch, res: RewardResult) -> tuple[RolloutBatch, dict]:
        """reward.on_failure for samples without a score: drop them (and groups left with < 2), fix a score, or abort."""
        r = self.cfg.reward
        missing = res.failed | res.not_applicable
        m = {"reward_failed_samples": int(res.failed.sum()), "reward_not_applicable": int(res.not_applicable.sum()),
             **{f"reward_{k}": v for k, v in res.counts.items()}}
        for k in ("failed_samples", "retries", "timeouts", "errors"):
            self.counters[f"reward_{k}_total"] += m[f"reward_{k}"]
        self.show_reward_errors(res.errors, "training")
        valid = ~missing & torch.isfinite(res.total)
        self._no_reward_steps = 0 if valid.any() else self._no_reward_steps + 1
        if not missing.any():
            return batch, m
        if r.on_failure == "abort":
            raise RunAborted(f"{int(res.failed.sum())} reward failures and {int(res.not_applicable.sum())} unscored "
                             f"samples in this step (reward.on_failure=abort); check the reward server/model, or set "
                             "reward.on_failure=drop")
        if r.on_failure == "fixed":
            batch.rewards = batch.rewards.clone()
            batch.rewards[missing] = r.failure_score
            return batch, m
        keep = ~missing
        for g in batch.group_ids.unique():
            in_g = batch.group_ids == g
            if int((keep & in_g).sum()) < 2:  # one sample has no baseline to be compared with
                keep &= ~in_g
                self.counters["dropped_groups_total"] += 1
        dropped = int((~keep).sum())
        m["dropped_samples"] = dropped
        self.counters["dropped_samples_total"] += dropped
        return subset(batch, keep), m

    def show_reward_errors(self, errors: dict[str, int], where: str) -> None:
        """Print the reward's own error text on stderr, once per distinct message (all are counted in metrics)."""
        for msg, n in errors.items():
            self._last_error = msg
            if msg in self._shown_errors or not self.writer:
                continue
            self._shown_errors.add(msg)
            if len(self._shown_errors) > 10:
                if len(self._shown_errors) == 11:
                    print("gerl: more distinct reward errors follow; not shown (see reward_errors in metrics.jsonl)",
                          file=sys.stderr)
                continue
            text = (msg.splitlines() or [""])[0][:300]
            print(f"gerl: reward {text} ({n} samples failed in {where}; each distinct error is shown once)",
                  file=sys.stderr)

    def check_reward_streak(self, step: int) -> None:
        """Stop (exit 3) after reward.max_failed_steps consecutive steps in which no sample got a valid reward, and
        end a run shorter than that with exit 3 too when none of its steps got one: it trained nothing."""
        limit = self.cfg.reward.max_failed_steps
        last = self._last_error or "every score was None (not applicable)"
        ran = step - self.start_step  # steps this process ran (a resumed run's earlier steps are not its own)
        # with reward.on_failure=fixed the failed samples were trained on their fixed score: the run did train
        if limit and step == self.cfg.max_steps and self._no_reward_steps == ran and self.cfg.reward.on_failure != "fixed":
            steps = f"the {ran} steps of this run" if not self.start_step else \
                f"the {ran} steps since resuming at step {self.start_step}"
            why = f"it ended before reward.max_failed_steps={limit} could stop it" if ran < limit else \
                f"reward.max_failed_steps={limit}"
            raise RunAborted(f"no sample got a valid reward in any of {steps}, so nothing was trained ({why}); reward "
                             f"said: {last[:200]}. Fix the reward (try it with `gerl score`) and rerun with " + (
                                 "resume=true and a higher max_steps" if self.start_step else "overwrite=true"))
        if limit and self._no_reward_steps >= limit:
            raise RunAborted(f"no sample got a valid reward in {self._no_reward_steps} consecutive steps (up to step "
                             f"{step}; reward.max_failed_steps={limit}); reward said: {last[:200]}. Checkpoints "
                             f"in {self.run_dir}/checkpoints are intact: fix the reward (try it with `gerl score`) "
                             "and rerun with resume=true")

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        cfg = self.cfg.train
        if self.tracker is not None:
            adv = self.tracker.advantages(batch.prompts, batch.rewards).clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        else:
            adv = compute_advantages(cfg.advantage, batch.rewards, batch.group_ids, cfg.adv_clip_max,
                                     unbiased=self.cfg.conventions.group_std == "unbiased")
        return -adv if cfg.flip_advantage else adv

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        k = self.cfg.validation.images_per_prompt  # image j of prompt i uses noise seed (validation.seed, i·k + j)
        prompts = [p.text for p in self.test_prompts for _ in range(k)]
        metadata = [dict(p.metadata) for p in self.test_prompts for _ in range(k)]
        images, res = self.engine.validate(prompts, metadata)
        self.show_reward_errors(res.errors, f"validation at step {step}")
        if self.writer:
            grid = image_grid(images, cols=k if k > 1 else None)  # a row per prompt when it has several images
            grid.save(self.run_dir / "samples" / f"val_step_{step:06d}.png")
            save_grid_captions(self.run_dir / "samples" / f"val_step_{step:06d}.json", prompts,
                               res.raw_total if res.raw_total is not None else res.total)
            self.logger.log_image("validation/images", grid, step)
        m = {"val_reward_mean": _finite_mean(res.total), "val_reward_raw_mean": _finite_mean(res.raw_total),
             "val_num_prompts": len(self.test_prompts), "val_images": len(prompts), "val_scored_prompts": int(torch.isfinite(res.total).sum())}
        for name, comp in res.components.items():
            m[f"val_reward/{name}_raw"] = _finite_mean(comp)
        if math.isnan(m["val_reward_mean"]) and self.writer:
            print(f"gerl: validation at step {step}: no prompt got a valid reward; val_reward_mean is logged as null",
                  file=sys.stderr)
        m["validate_s"] = time.perf_counter() - t0
        return m

    def checkpoint(self, step: int) -> None:
        extra = {"sampler": self.sampler_after.get(step), "tracker": self.tracker.state_dict() if self.tracker else None,
                 "counters": self.counters}
        if self.cfg.engine.schedule == "stream":  # a resumed stream restarts at its first unfinished draw
            stream = self.engine.stream.state_dict()
            extra.update(sampler=self.sampler_after[stream["first_draw"] - 1], stream=stream)
        self.engine.save(self.run_dir, step, extra, self.cfg.checkpoint.keep_last)
        self._checkpointed = step

    # ------------------------------------------------------------------ the loop
    def _on_signal(self, signum, frame) -> None:
        """First SIGINT/SIGTERM: finish the current step, checkpoint, stop. A second one stops at once."""
        if self._stop_signal is not None:
            raise KeyboardInterrupt
        self._stop_signal = signum
        print(f"\ngerl: {signal.Signals(signum).name} received: stopping after this step with a checkpoint "
              "(send it again to stop at once, without one)", file=sys.stderr)

    def _install_signal_handlers(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}  # signals are delivered to the main thread only; an embedding caller handles them itself
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _stop_here(self, step: int) -> None:
        """Called at a step boundary after a signal: make sure this step is checkpointed, then raise Interrupted."""
        if step > self.start_step and self._checkpointed != step:  # decided alike on every rank (torchrun)
            with self.timeline.span("trainer", "checkpoint", step):
                self.checkpoint(step)
        ckpt = self.run_dir / "checkpoints" / f"step_{step:06d}" if step > self.start_step else None
        raise Interrupted(step, ckpt, self._stop_signal)

    def _print_line(self, step: int, metrics: dict) -> None:
        """The plain progress line (no progress bar, or stderr is not a terminal)."""
        keys = ("reward_mean", "reward_raw_mean", "val_reward_mean", "step_s", "policy_lag")
        parts = [f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                 for k in keys if k in metrics and metrics[k] is not None]
        print(f"gerl: step {step}/{self.cfg.max_steps} " + " ".join(parts), file=sys.stderr, flush=True)

    def fit(self) -> Path:
        cfg = self.cfg
        if self.writer:
            print("gerl: " + ", ".join(f"{k}={v}" for k, v in self.sizes.items()), file=sys.stderr)
            print(f"gerl: transformer: {speed(to_dict(cfg))}", file=sys.stderr)
        if self.planner is not None:  # a GPU run: what each role should peak at, before it does
            plan = self.planner.result()
            if plan is not None:
                from gerl.plan import format_plan

                print(format_plan(plan).rstrip("\n"), file=sys.stderr)
                self.plan_metrics = plan.metrics()
            else:
                print(f"gerl: no memory plan ({self.planner.error or 'still computing'}); `gerl plan` explains",
                      file=sys.stderr)
        progress = None
        # tqdm's carriage-return stream is unreadable in a log file: off a terminal, print plain lines instead.
        if cfg.log.progress_bar and sys.stderr.isatty() and self.writer:
            from tqdm import tqdm

            progress = tqdm(total=cfg.max_steps, initial=self.start_step, desc="train", file=sys.stderr, dynamic_ncols=True)
        ahead = cfg.engine.max_staleness if cfg.engine.schedule == "async" else 0
        stream = cfg.engine.schedule == "stream"  # the engine keeps its rollouts busy from one prompt stream
        pending: deque = deque()  # (step, handle) of generations issued but not yet trained on
        next_gen = self.start_step + 1
        handlers = self._install_signal_handlers()
        try:
            if cfg.validation.every > 0 and self.start_step == 0:
                with self.timeline.span("trainer", "validate", 0):
                    row = self.validate(0)
                    row.update(self.throughput.update(row))
                    self.logger.log(0, row)
            self._step_clock = time.perf_counter()  # step_s runs from the end of the previous step (see run_step)
            for step in range(self.start_step + 1, cfg.max_steps + 1):
                # Keep `ahead` batches generating beyond the one trained now (none for the sync schedule).
                while not stream and next_gen <= min(step + ahead, cfg.max_steps):
                    pending.append((next_gen, self.engine.submit(next_gen, *self.next_prompts(next_gen))))
                    next_gen += 1
                gen_step, handle = pending.popleft() if not stream else (step, {"stream": step})
                assert gen_step == step
                metrics = self.run_step(step, handle)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward_mean']:.4g}", s=f"{metrics['step_s']:.2f}",
                                         lag=metrics["policy_lag"])
                elif cfg.log.print_every and (step % cfg.log.print_every == 0 or step == cfg.max_steps) and self.writer:
                    self._print_line(step, metrics)
                stop = self._stop_signal is not None
                if step < cfg.max_steps and getattr(self.engine, "any_rank", lambda f: f)(stop):
                    self._stop_here(step)  # torchrun: all processes at this step, whichever saw the signal
                self.check_reward_streak(step)
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)
            if progress is not None:
                progress.close()
            self.engine.close()
            self.logger.close()
            self.timeline.flush()
        return self.run_dir

    def run_step(self, step: int, handle) -> dict:
        """collect the step's rewarded batch → failure policy → advantages + update → sync → validate/log/save."""
        cfg, tl = self.cfg, self.timeline
        # From the end of the previous step (after its validation/checkpoint), so that generation submitted by
        # fit() before this call — all of it with the local engine — is inside this step's wall time.
        t0 = self._step_clock
        with tl.span("trainer", "step", step):
            with tl.span("trainer", "wait_rollout", step):
                batch, res = self.engine.collect(handle)
            generated, full_batch = len(batch), batch
            lag = self.engine.actor_version - batch.policy_version  # training steps between generation and update
            batch, fault_metrics = self.apply_failure_policy(batch, res)
            with tl.span("trainer", "train", step):
                metrics = self._train_on(batch, step, res)
            with tl.span("trainer", "sync", step):
                metrics["sync_s"] = self.engine.sync()
            metrics.update(fault_metrics)
            metrics.update(policy_lag=lag, rollout_restarts=self.engine.restarts)
            host_peaks = [metrics[k] for k in ("actor_peak_mem_gib", "rollout_peak_mem_gib") if k in metrics]
            if cfg.engine.kind == "ray" and host_peaks:  # the hosts' own peaks, not this driver's
                metrics["peak_mem_gib"] = max(host_peaks)
            metrics.update(self.plan_metrics)  # predicted beside measured (GPU runs)
            if cfg.engine.kind == "ray" and is_gpu_run(cfg):  # the driver must hold no CUDA memory
                metrics["driver_cuda_initialized"] = torch.cuda.is_initialized()
            metrics["step_s"] = time.perf_counter() - t0
            metrics["images"] = generated
            metrics["images_per_s"] = generated / metrics["step_s"]
            every = cfg.validation.every  # the run always ends with a validation unless it is off (-1)
            if every >= 0 and (step == cfg.max_steps or every > 0 and step % every == 0):
                with tl.span("trainer", "validate", step):
                    metrics.update(self.validate(step))
            if cfg.log.images_every and step % cfg.log.images_every == 0 and self.writer:
                grid = image_grid(full_batch.images[: 4 * cfg.data.group_size], cols=cfg.data.group_size)
                grid.save(self.run_dir / "samples" / f"train_step_{step:06d}.png")
                self.logger.log_image("train/images", grid, step)
            spans = metrics.pop("_spans", [])
            metrics.update(self.throughput.update(metrics, text_len=full_batch.embeds.prompt.shape[1],
                                                  trained_images=len(batch),
                                                  cond_tokens=reference_tokens(full_batch.embeds)))
            self.logger.log(step, metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or step == cfg.max_steps:
                with tl.span("trainer", "checkpoint", step):
                    self.checkpoint(step)
        for sp in full_batch.spans:
            tl.add(f"rollout{sp.get('shard', 0)}", sp["name"], sp["start"], sp["end"], step)
        for sp in list(res.spans) + spans:
            tl.add(sp["lane"], sp["name"], sp["start"], sp["end"], step)
        tl.flush()
        self._step_clock = time.perf_counter()
        return metrics

    def _train_on(self, batch: RolloutBatch, step: int, res: RewardResult | None = None) -> dict:
        r = batch.rewards
        finite = torch.isfinite(r)
        m = {
            "reward_mean": float(r[finite].mean()) if finite.any() else math.nan,
            "reward_std": float(r[finite].std(unbiased=False)) if finite.any() else math.nan,
            "policy_version": batch.policy_version,
            **batch.timings,
        }
        if res is not None:  # normalised components make reward_mean ≈ 0: the raw scores are what moves
            m["reward_raw_mean"] = _finite_mean(res.raw_total)
            for name, comp in res.components.items():
                m[f"reward/{name}_raw"] = _finite_mean(comp)
        for k, v in batch.reward_extras.items():
            vals = [float(x) for x in v if isinstance(x, (int, float)) and math.isfinite(x)]
            if vals:
                m[f"reward/{k}"] = sum(vals) / len(vals)
        t0 = time.perf_counter()
        if len(batch) == 0:
            pass  # every group was dropped for failed rewards: nothing to learn from this step
        elif not finite.all():
            # A missing or non-finite reward makes the whole group's baseline meaningless: skip this update.
            self.counters["nonfinite_reward_steps_skipped"] += 1
        else:
            adv = self.advantages(batch)
            stats = self.engine.update(batch, adv, step)
            self.counters["nonfinite_updates_skipped"] += stats.pop("nonfinite_updates_skipped")
            m.update(stats)
            m["advantage_abs_mean"] = float(adv.abs().mean())
            if not self._first_update_checked:
                self._first_update_checked = True
                warning = first_update_warning(m, self.cfg)
                if warning and self.writer:
                    print(f"gerl: WARNING: {warning}", file=sys.stderr, flush=True)
        m["train_s"] = time.perf_counter() - t0
        m.update(self.counters)
        return m


def first_update_warning(m: dict, cfg: Config) -> str | None:
    """What is wrong when the run's first update learned nothing (zero, non-finite or no gradient step), or None.
    A silent failure otherwise: fp16 without loss scaling, for one, trains nothing and raises nothing."""
    gn, steps = m.get("grad_norm"), m.get("optimizer_steps")
    if steps == 0:
        why = ("every optimizer step overflowed under fp16 loss scaling (the scale halves each time; later steps "
               "should recover)" if m.get("overflow_updates_skipped") else "every optimizer step was skipped for a "
               "non-finite loss or gradient (see nonfinite_updates_skipped)")
        return f"the first update took no optimizer step: {why}"
    if gn is None or (math.isfinite(gn) and gn > 0):
        return None
    if not math.isfinite(gn):
        return f"the first update's gradient norm is {gn}; check the reward and model.dtype"
    if m.get("advantage_abs_mean", 0.0) == 0:
        return ("the first update's gradient norm is 0 because every advantage is 0 (each group's images got equal "
                "rewards): the reward does not tell this model's images apart; check it with `gerl score`")
    hint = (" With model.dtype=fp16 the per-element gradients (~1e-9 at 512 px) flush to zero unless "
            "train.fp16_loss_scale > 0; use it, or bf16." if cfg.model.dtype == "fp16" else "")
    return f"the first update's gradient norm is 0 although the advantages are not: nothing is being learned.{hint}"


def _finite_mean(t: torch.Tensor | None) -> float:
    """Mean over the finite entries; NaN (logged as null) when there are none."""
    if t is None:
        return math.nan
    ok = torch.isfinite(t)
    return float(t[ok].double().mean()) if ok.any() else math.nan


class _NoLogger:
    """The metrics logger of a process that does not write the run directory (torchrun: ranks > 0)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_image(self, *args) -> None:
        pass

    def close(self) -> None:
        pass


def train(cfg: Config) -> Path:
    from gerl.engine import launcher
    from gerl.engine.rehearse import adapt

    cfg = adapt(launcher.adapt(cfg))  # torchrun's N processes; engine.rehearse: the GPU layout on CPU (each says so)
    launcher.start(cfg)  # engine.env; under torchrun: this process's GPU and the launcher's process group
    gpu = is_gpu_run(cfg) and launcher.rank() == 0
    planner = MemoryPlanner(cfg) if gpu else None  # printed when training starts
    return Trainer(cfg, prepare(cfg), planner).fit()
