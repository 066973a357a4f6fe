"""Checkpoints: safetensors + JSON only (nothing is unpickled), written to a temp dir and renamed into place.

checkpoints/step_NNNNNN/
  pytorch_lora_weights.safetensors  the LoRA, loadable by StableDiffusion3Pipeline.load_lora_weights (with its
                                    adapter metadata, so alpha/r scaling is right)     [LoRA runs]
  transformer/                      the full transformer, diffusers format, in model.dtype [full fine-tuning]
  trainable.safetensors             the trained parameters by module name, fp32 (the masters of bf16 weights:
                                    exact resume)
  optimizer.safetensors             AdamW moments and step counts
  ema.safetensors                   EMA shadow weights (if train.ema_decay > 0)
  anchor.safetensors                nft/awm/dgpo's anchor
  rng.safetensors                   torch CPU RNG state
  inflight_weights.safetensors      older policy versions still generating ahead ("v{version}/{name}"), so an
                                    async resume re-issues those generations with the very same weights
  trainer_state.json                step, optimizer hyper-parameters, LR-schedule position, data position,
                                    per-prompt tracker, Python/NumPy RNG, policy version

Sharded runs (engine.fsdp=true) write the state that is sharded — trained weights (fp32), AdamW state, EMA,
anchor — with torch.distributed.checkpoint instead: `sharded/`, one file per rank plus DCP's `.metadata` (a pickle
written and read by torch: the one pickle in a gerl checkpoint; resume only checkpoints you trust). Every actor rank
writes its own shards, so the run directory must be on a filesystem all actor hosts share. The transformer/ (or
the LoRA files) are still written whole by rank 0, in the format stock `from_pretrained` (load_lora_weights) reads.
Resume is bit-exact on the same number of actor ranks (tests/engine/test_fsdp.py); DCP reshards on load, so another
number of ranks resumes too (docs/architecture.md, "Data parallel layer").
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from gerl.models.family import family_of

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gerl.errors import UserError
from gerl.models.loader import save_lora


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def _optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v  # replicated by the data-parallel layer
            tensors[f"{pid}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_state_like_params(actor) -> None:
    """After loading whole AdamW moments into an optimizer over the data-parallel layer's DTensors: each moment
    distributed like its parameter (every rank holds the whole tensor; a shard takes its slice)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p in actor.params:
        if not isinstance(p, DTensor):
            continue
        st = actor.optimizer.state.get(p, {})
        for k, v in st.items():
            if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
                st[k] = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def _sharded_state(actor) -> dict:
    """What a sharded checkpoint holds, as DTensors (DCP reads into these tensors in place)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    names = [n for n, _ in actor.named_params]
    state = {"trainable": dict(zip(names, (p.detach() for p in actor.params))),
             "optimizer": get_optimizer_state_dict(actor.transformer, actor.optimizer)}
    if actor.ema is not None:
        state["ema"] = dict(zip(names, actor.ema.shadow))
    if actor.anchor is not None:
        state["anchor"] = dict(zip(names, actor.anchor))
    return state


def export_transformer(actor, directory: Path) -> None:
    """The full transformer as a diffusers directory in the model dtype, which stock `from_pretrained` loads. Under
    the data-parallel layer every rank gathers each tensor in turn (its weights are fp32 masters, sharded or
    replicated) and rank 0 writes, as diffusers' save_pretrained would (config, ≤ 10 GB safetensors shards with
    their index)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from gerl.models.family import compute_dtype

    tr, dp = actor.transformer, actor.dp
    if dp is None:
        tr.save_pretrained(directory, safe_serialization=True)
        return
    dtype, keep, state = compute_dtype(tr), dp.rank == 0, {}
    for k, v in tr.state_dict().items():
        whole = dp.full(v.detach())
        if keep:
            state[k] = (whole.to(dtype) if whole.is_floating_point() else whole).cpu().contiguous()
    if not keep:
        return
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(tr.to_json_string())
    config["_class_name"] = family_of(tr).transformer_class  # the engine renamed the class (FSDP…, Replicate…)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    split = split_torch_state_dict_into_shards(state, filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                                               max_shard_size="10GB")
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir: Path, step: int, actor, extra_state: dict, keep_last: int = 0,
                    inflight: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint of `step` atomically and prune old ones. `extra_state` must be JSON-serialisable;
    `inflight` (older versions' weights by "v{version}/{name}") goes to inflight_weights.safetensors."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    sharded = actor.dp is not None and actor.dp.sharded  # then every actor rank is here; rank 0 writes the rest
    writer = actor.dp is None or actor.dp.rank == 0
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if sharded:
        import torch.distributed.checkpoint as dcp

        actor.dp.sum([0.0])  # a barrier: the directory exists (and holds nothing older) before any rank writes
        dcp.save(_sharded_state(actor), checkpoint_id=str(tmp / "sharded"), process_group=actor.dp.group)
    if actor.lora:
        weights = actor.trainable_state()  # whole adapter tensors (gathered over the ranks under shards)
        if writer:
            save_lora(actor.transformer, tmp, state_dict=weights)
    else:
        export_transformer(actor, tmp / "transformer")
    if not writer:
        return final
    if not sharded:
        save_file(actor.trainable_state(), str(tmp / "trainable.safetensors"))
        opt_tensors, _ = _optimizer_to_flat(actor.optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        if actor.ema is not None:
            save_file(actor.ema_state(), str(tmp / "ema.safetensors"))
        if actor.anchor is not None:  # nft/awm/dgpo: the old policy, part of the exact state
            save_file(actor.anchor_state(), str(tmp / "anchor.safetensors"))
    opt_meta = {"param_groups": actor.optimizer.state_dict()["param_groups"]}
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    if inflight:
        save_file(inflight, str(tmp / "inflight_weights.safetensors"))
    np_state = np.random.get_state()
    state = {
        "step": step,
        "policy_version": actor.version,
        "optimizer": opt_meta,
        "lr_scheduler": actor.lr_scheduler.state_dict(),
        "loss_scaler": actor.scaler.state_dict() if actor.scaler is not None else None,
        "optimizer_steps": actor.optimizer_steps,
        "python_rng": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        **extra_state,
    }
    state["lr_scheduler"].pop("lr_lambdas", None)
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                  and (p / "trainer_state.json").is_file())


def find_resume_checkpoint(run_dir: Path, resume: str) -> Path | None:
    """resume = "false" → None; "true" → the latest checkpoint in run_dir (None if there is none yet); a path →
    that checkpoint. A UserError when the chosen checkpoint is damaged (see verify_resume_checkpoint)."""
    if resume in ("false", ""):
        return None
    if resume == "true":
        ckpts = list_checkpoints(run_dir)
        if ckpts:
            verify_resume_checkpoint(ckpts[-1])
        return ckpts[-1] if ckpts else None
    p = Path(resume)
    if not (p / "trainer_state.json").is_file():
        raise UserError(f"resume={resume}: not a checkpoint directory (no trainer_state.json); "
                        "pass resume=true or a path like RUN/checkpoints/step_000010")
    verify_resume_checkpoint(p)
    return p


STATE_KEYS = ("step", "policy_version", "optimizer", "lr_scheduler", "python_rng", "numpy_rng")


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path` for an exact resume, or None. Reads only safetensors headers
    (which also catch a truncated file: the header must cover every tensor's bytes) and trainer_state.json."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "trainer_state.json is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"trainer_state.json is damaged ({e})"
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        return f"trainer_state.json lacks {', '.join(missing)}"
    if (path / "sharded").is_dir():  # engine.fsdp=true: torch.distributed.checkpoint's files
        if not (path / "sharded" / ".metadata").is_file():
            return "sharded/.metadata is missing"
        needed = ["rng.safetensors"]
    else:
        needed = ["trainable.safetensors", "optimizer.safetensors", "rng.safetensors"]
    for name in needed + (["ema.safetensors"] if (path / "ema.safetensors").exists() else []):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = list(st.keys())
        except (SafetensorError, OSError) as e:
            return f"{name} is damaged ({str(e).splitlines()[0][:120]})"
        if name == "rng.safetensors" and "torch_cpu" not in keys:
            return f"{name} holds no torch_cpu RNG state"
    return None


def verify_resume_checkpoint(path: Path) -> None:
    """UserError naming the damaged file and the checkpoint to resume from instead, when `path` cannot be resumed.
    Called before anything is written, so a refused resume leaves the run directory as it was."""
    problem = checkpoint_problem(path)
    if problem is None:
        return
    earlier = [c for c in list_checkpoints(Path(path).parent.parent) if c.name < Path(path).name
               and checkpoint_problem(c) is None]
    fix = (f"resume from the previous checkpoint with resume={earlier[-1]} (or delete {path} and pass resume=true)"
           if earlier else "no earlier checkpoint is intact: start over with overwrite=true")
    raise UserError(f"checkpoint {path} cannot be resumed: {problem}; {fix}")


def load_checkpoint(path: Path, actor) -> dict:
    """Restore the actor (weights, optimizer, LR schedule, EMA) and RNGs; return the JSON state for the rest."""
    state = json.loads((path / "trainer_state.json").read_text())
    config = Path(path).parent.parent / "config.yaml"
    sharded = (path / "sharded").is_dir()
    if sharded != (actor.dp is not None and actor.dp.sharded):
        raise UserError(f"checkpoint {path} was written with engine.fsdp={str(sharded).lower()}; resume with that "
                        f"setting (see {config})")
    if actor.anchor is not None and not sharded and not (path / "anchor.safetensors").is_file():
        raise UserError(f"checkpoint {path} has no anchor.safetensors: it was not written by an algo.name=nft/awm/dgpo "
                        f"run; resume it with the algo it was trained with (see {config})")
    try:
        if sharded:
            _load_sharded(path, actor)
        else:
            actor.load_trainable_state(load_file(str(path / "trainable.safetensors")))
            actor.optimizer.load_state_dict(_optimizer_from_flat(load_file(str(path / "optimizer.safetensors")),
                                                                 state["optimizer"]))
            _optimizer_state_like_params(actor)
            if actor.ema is not None and (path / "ema.safetensors").is_file():
                actor.load_state(actor.ema.shadow, load_file(str(path / "ema.safetensors")))
            if actor.anchor is not None:
                actor.load_anchor_state(load_file(str(path / "anchor.safetensors")))
    except (ValueError, RuntimeError, KeyError) as e:  # shapes or names of another model / LoRA rank / targets
        raise UserError(f"checkpoint {path} does not fit this config ({str(e).splitlines()[0][:160]}); resume with the "
                        f"model and LoRA settings it was trained with (see {config})") from None
    sched = actor.lr_scheduler.state_dict()
    sched.update({k: v for k, v in state["lr_scheduler"].items() if k in sched})
    actor.lr_scheduler.load_state_dict(sched)
    if actor.scaler is not None and state.get("loss_scaler"):
        actor.scaler.load_state_dict(state["loss_scaler"])
    actor.optimizer_steps = int(state.get("optimizer_steps", 0))
    actor.version = state["policy_version"]
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
    py = state["python_rng"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npr = state["numpy_rng"]
    np.random.set_state((npr[0], np.array(npr[1], dtype=np.uint32), *npr[2:]))
    return state


def _load_sharded(path: Path, actor) -> None:
    """DCP reads every rank's part of the trained weights, AdamW state, EMA and anchor in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    target = _sharded_state(actor)
    dcp.load(target, checkpoint_id=str(path / "sharded"), process_group=actor.dp.group)
    set_optimizer_state_dict(actor.transformer, actor.optimizer, target["optimizer"])


def load_inflight_weights(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """{version: {name: tensor}} of the older policy versions a checkpoint kept for in-flight generations."""
    f = Path(path) / "inflight_weights.safetensors"
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in (load_file(str(f)).items() if f.is_file() else []):
        v, name = key.split("/", 1)
        out.setdefault(int(v[1:]), {})[name] = t
    return out
