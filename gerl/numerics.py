"""Does low-precision training compute what fp32 would? A GPU's fp16 GEMM numerics emulated on a CPU, and the
replay check: `ActorWorker.update` on a rollout's recorded steps, its ratio before the update and its LoRA gradient
against the same update's on an fp32 copy (benchmarks/bench_gpu.py's ratio and gradient checks).

Why the emulation: on a CPU without avx512_fp16, PyTorch's fp16 matrix products are ~100–170× slower than fp32
((4205 × 1536) @ (1536 × 1536): 16 s in fp16, 0.1 s in fp32 on this project's EPYC), and the CPU flash-attention
backward in fp16 is ~20× slower than in bf16, so one backward of two SD3.5-M blocks at 512 px takes minutes. A
GPU's fp16 GEMM reads fp16 operands, accumulates in fp32 and rounds the result to fp16 once; computing the product
in fp32 from the same fp16 operands and rounding once gives those numerics (up to summation order) at fp32 speed.
Everything else stays real fp16 — activations, the gradients between layers, every cast — and fp16 casts and
subnormals on a CPU are IEEE, the same as a GPU's, so gradient underflow reproduces exactly.

    with Fp16GemmEmulation():
        loss = model_fp16(x).float().mean()
        loss.backward()
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# Ops emulated in fp32 with one rounding of each output: the products that nn.Linear and matmul dispatch to
# (forward and backward), and the CPU flash-attention backward. The flash-attention forward is left alone: on a
# CPU it is fast in fp16 and, like a GPU's flash kernel, keeps the scores and the softmax statistics in fp32 (its
# output is within about one fp16 ulp of an fp32 attention's).
EMULATED = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.mv.default,
    aten.addmv.default, aten.dot.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.float16 else x


def _is_fp16(func, args) -> bool:
    if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return args[1].dtype == torch.float16  # q (its logsumexp input is fp32 in every dtype)
    # every operand fp16: a mixed-dtype product is left to raise its usual error
    return all(a.dtype == torch.float16 for a in args if isinstance(a, torch.Tensor))


class Fp16GemmEmulation(TorchDispatchMode):
    """fp16 mm / addmm / bmm / baddbmm / mv / addmv / dot and the CPU flash-attention backward computed in fp32
    from their fp16 inputs, each output rounded to fp16 once: the numerics of a GPU fp16 GEMM with fp32
    accumulation, at fp32 speed on a CPU. Ops with no fp16 operand, and every other op, run unchanged.

    Not emulated exactly: a GPU flash-attention backward rounds its internal dS (the softmax gradient) to fp16
    before the dQ/dK products; here it stays fp32 until dQ, dK and dV are rounded. With loss scaling dS sits well
    inside fp16's range, so the difference is rounding-level; without it the inter-layer gradients underflow first.
    `calls` counts the emulated calls (to show that the mode was exercised).
    """

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in EMULATED and _is_fp16(func, args):
            self.calls += 1
            out = func(*tree_map(_up, args), **tree_map(_up, kwargs))
            if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                # grad_q, grad_k, grad_v in the dtype of q, k, v
                return tuple(g.to(a.dtype) for g, a in zip(out, args[1:4]))
            return out.half()
        return func(*args, **kwargs)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients as one fp64 vector (a parameter without a gradient counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten().cpu()
                      for p in params])


def grad_agreement(grads: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """How well a low-precision gradient matches a reference (fp32) one; both flat vectors of the same length.

    Returns:
        cosine: cos(grads, reference), 0 when either is all zeros (nothing to align);
        zero_fraction: fraction of entries of `grads` that are exactly 0 (underflow flushes whole entries);
        reference_zero_fraction: the same for `reference` (what is zero by construction, e.g. a LoRA's A at B = 0);
        norm_ratio: |grads| / |reference|.
    """
    g, r = grads.double(), reference.double()
    gn, rn = float(g.norm()), float(r.norm())
    return {"cosine": float(g @ r) / (gn * rn) if gn > 0 and rn > 0 else 0.0,
            "zero_fraction": float((g == 0).double().mean()),
            "reference_zero_fraction": float((r == 0).double().mean()),
            "norm_ratio": gn / rn if rn > 0 else float("nan")}


class FirstGrads:
    """ActorWorker's grad_sync hook that keeps the first gradients it is handed (unscaled, before clipping and the
    optimizer step) as one flat fp64 vector, and whether the loss and the gradients were finite."""

    def __init__(self):
        self.flat, self.finite = None, None

    def __call__(self, params, loss_ok: bool, grads_ok: bool) -> tuple[bool, bool]:
        if self.flat is None:
            self.flat, self.finite = flat_grads(params), bool(loss_ok and grads_ok)
        return loss_ok, grads_ok


@contextlib.contextmanager
def true_fp32():
    """fp32 matmuls without TF32 (whose 10-bit mantissa is fp16's) on a GPU, for an fp32 reference."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@torch.no_grad()
def perturb_fresh_lora(transformer, std: float = 1e-3, seed: int = 0) -> bool:
    """Seeded random lora_B ~ N(0, std²) when every lora_B is still PEFT's zero init, where grad A ≡ 0 by
    construction (half the entries a gradient check compares). True when it did."""
    bs = [p for n, p in transformer.named_parameters() if "lora_B" in n]
    if any(bool(p.any()) for p in bs):
        return False
    g = torch.Generator().manual_seed(seed)
    for p in bs:
        p.copy_(torch.randn(p.shape, generator=g).to(p.device) * std)
    return True


def replay_check(make_actor, transformer, batch, advantages: torch.Tensor, micro_sizes: tuple[int, ...],
                 grad_check: bool = True, stage=None, bar: float = 0.99, control=None) -> dict:
    """`ActorWorker.update` replaying a rollout's recorded steps at the rollout's weights, once per training
    micro-batch size; the trainable weights are restored after each.

    Args:
        make_actor: (transformer, micro_batch_size, grad_sync, recompute_old_log_probs) -> ActorWorker, its
            mini-batch the whole batch (every replay happens before its one optimizer step).
        transformer: the model that made the rollout (bf16/fp16 base, fp32 LoRA).
        batch: the RolloutBatch with the recorded steps and the rollout's log-probs; advantages: (B,).
        grad_check: also run the largest size's update on an fp32 copy (the same weights upcast) and compare the
            LoRA gradients. The copy recomputes its old log-probs in fp32, so that its ratio starts at 1 as the
            low-precision update's does: the rollout's log-probs are off by the dtype's error (|ratio − 1| of an
            fp32 replay: 1e-6 fp16, 3.5e-6 bf16 at 2 SD3.5-M blocks; more with depth), and past the clip range the
            clip would silence the very gradients being compared.
        stage: name -> context manager (memory peaks), optional; bar: the cosine the gradient check accepts.
        control: with grad_check, another make_actor whose update's LoRA gradient is compared with the same fp32
            reference on the same batch (e.g. fp16 without loss scaling: the failure that scaling prevents, paired
            with the scaled update on one rollout instead of a second run with its own rollout and reference).
    Returns:
        {"max_abs_ratio_minus_1": {size: max |ratio − 1| before the update}, and with grad_check "grad_check":
        grad_agreement's numbers plus the update's loss scale, clipfrac and finiteness, and the fp32 copy's; with
        control, grad_check["control"]: the same numbers for the control's update}.
    """
    stage = stage or (lambda name: contextlib.nullcontext())
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]

    @torch.no_grad()
    def restore():
        for p, s in zip(trainable, saved):
            p.copy_(s)

    devs = {}
    for mb in micro_sizes:
        hook = FirstGrads()
        with stage("ratio_check"):
            metrics = make_actor(transformer, mb, hook, False).update(batch, advantages, 0)
        devs[mb] = metrics["ratio_max_dev_before_update"]
        restore()
    out = {"max_abs_ratio_minus_1": devs}
    if not grad_check:
        return out
    reference, ref_hook = copy.deepcopy(transformer).float(), FirstGrads()
    with stage("grad_check_fp32"), true_fp32():
        ref_metrics = make_actor(reference, mb, ref_hook, True).update(batch, advantages, 0)
    del reference
    out["grad_check"] = {
        "micro_batch": mb, "trained_steps": metrics["trained_steps_per_sample"], "bar": bar,
        "loss_scale": metrics.get("loss_scale"), "finite": hook.finite, "entries": hook.flat.numel(),
        "clipfrac": metrics.get("clipfrac", 0.0), "reference_clipfrac": ref_metrics.get("clipfrac", 0.0),
        "reference_ratio_dev": ref_metrics["ratio_max_dev_before_update"],
        **grad_agreement(hook.flat, ref_hook.flat),
    }
    if control is not None:
        ctrl_hook = FirstGrads()
        with stage("grad_check_control"):
            ctrl = control(transformer, mb, ctrl_hook, False).update(batch, advantages, 0)
        restore()
        out["grad_check"]["control"] = {
            "loss_scale": ctrl.get("loss_scale"), "finite": ctrl_hook.finite, "clipfrac": ctrl.get("clipfrac", 0.0),
            "ratio_dev": ctrl["ratio_max_dev_before_update"], **grad_agreement(ctrl_hook.flat, ref_hook.flat),
        }
    return out
