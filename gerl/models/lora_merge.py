"""The exact merged LoRA (`model.merge_lora`): one forward for rollout and training.

PEFT's LoRA forward is W0·x + s·B(A·x): two more matmuls per adapted linear, which cost 29–41 % of the rollout's
images/s on an H100 (docs/benchmarks.md, gpu_day, rollout). Here each adapted linear computes

    y = W_m·x + bias,   W_m = round(W0 + Σ s·B·A)   (the sum in fp32, rounded once to the model dtype)

in the rollout (no grad) and in the training replay alike, so both compute the same velocity by construction, bit for
bit for the same batch shape, in bf16 too: the ratio before an update is the unmerged run's (1 to the SDE step's own
fp32 rounding), where PEFT's unmerged training forward beside a merged rollout gave |ratio − 1| up to 3.6e-5. The backward (`_MergedLinear`) differentiates
W_m = W0 + s·B·A: dx = dy·W_m, and dA, dB in the adapter's own dtype (fp32), as PEFT's own path computes them:
dB = s·dyᵀ(x·Aᵀ), dA = s·(dy·B)ᵀx.

W_m is a non-persistent buffer of each adapted linear (`merged_weight`, one more copy of the adapted linears in the
model dtype; no state dict, LoRA export or checkpoint sees it). W0 stays in the base layer untouched, so the
adapters switched off (`disable_adapters()`: the KL reference, DGPO's base) compute exactly W0·x.

Re-merging: a forward pre-hook on the transformer root re-merges each layer whose W0, A, B (identity, storage,
autograd version counter), active adapters or scaling changed since its W_m was built — after an optimizer step,
an EMA/anchor swap, staged or synced weights, a resume, `p.data = …`. It runs outside the transformer's blocks, so a
compiled block sees a plain function of tensors. A write the version counter does not see (`p.data.copy_(…)`, a
fused optimizer) needs `remerge(transformer)`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear, LoraLayer
from torch import nn


def lora_layers(transformer) -> list:
    """The PEFT LoRA layers of `transformer` that hold an adapter."""
    return [m for m in transformer.modules() if isinstance(m, LoraLayer) and len(m.lora_A) > 0]


class _MergedLinear(torch.autograd.Function):
    """y = x·W_mᵀ + bias, differentiated as if W_m = W0 + Σ sᵢ·Bᵢ·Aᵢ (W0 frozen: no gradient for W_m itself).
    Inputs: x (..., in) and W_m (out, in) in the model dtype; scalings: one float per adapter; ab: A₁, B₁, A₂, …
    ((r, in), (out, r)) in the adapter's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, scalings, *ab):
        ctx.scalings = scalings
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, *ab)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, *ab = ctx.saved_tensors
        dx = dy.to(weight.dtype) @ weight if ctx.needs_input_grad[0] else None
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grads = []
        for i, s in enumerate(ctx.scalings):
            a, b = ab[2 * i], ab[2 * i + 1]
            if not (ctx.needs_input_grad[4 + 2 * i] or ctx.needs_input_grad[5 + 2 * i]):
                grads += [None, None]
                continue
            # in the adapter's dtype, as PEFT's unmerged path: x is cast to A's dtype, dy reaches B's output upcast
            xf = x.reshape(-1, x.shape[-1]).to(a.dtype)  # (N, in)
            dv = dy.reshape(-1, dy.shape[-1]).to(a.dtype) * s  # (N, out)
            grads += [(dv @ b).T @ xf, dv.T @ (xf @ a.T)]  # dA (r, in), dB (out, r)
        return dx, None, dbias, None, *grads


def _active(m) -> list[str]:
    return [a for a in m.active_adapters if a in m.lora_A]


class MergedLoraLinear(LoraLinear):
    """PEFT's lora.Linear with the merged forward. A layer is switched by setting its __class__, so isinstance
    checks, PEFT's own methods (disable_adapters, set_adapter) and the LoRA exports keep working."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = _active(self)
        if self.disable_adapters or not names:
            return self.base_layer(x)  # the adapters off: exactly W0·x + bias
        if not torch.is_grad_enabled():  # the rollout: _MergedLinear.forward's own F.linear, bit for bit (and
            return F.linear(x, self.merged_weight, self.base_layer.bias)  # dynamo cannot trace the Function here)
        ab = [t for a in names for t in (self.lora_A[a].weight, self.lora_B[a].weight)]
        scalings = tuple(self.scaling[a] for a in names)
        return _MergedLinear.apply(x, self.merged_weight, self.base_layer.bias, scalings, *ab)


def _key(t: torch.Tensor) -> tuple:
    # identity, storage (`p.data = …` swaps it and keeps the version counter) and in-place writes
    return id(t), t.untyped_storage()._cdata, t._version


def _stamp(m) -> tuple:
    """What W_m was built from. The modules holding W0, A and B are looked up once per merge (m._gerl_parts): an
    nn.Module attribute costs microseconds, and this runs for every adapted linear before every forward."""
    names, base, ab = m._gerl_parts
    return (tuple(m.active_adapters), _key(base._parameters["weight"]),
            *(k for a, b in ab for k in (_key(a._parameters["weight"]), _key(b._parameters["weight"]))),
            *(m.scaling[n] for n in names))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated adapter tensor (the data-parallel layer's DTensor between steps) as the plain tensor it holds
    whole on every rank; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def _merge(m) -> None:
    """W_m = W0 + Σ s·B·A summed in fp32 (the adapter's dtype when wider), rounded once, written in place when the
    buffer fits (a compiled graph keeps reading the same tensor)."""
    if m.merged:
        raise RuntimeError("model.merge_lora: PEFT's merge_adapter wrote the adapter into W0; unmerge it first")
    names = _active(m)
    m._gerl_parts = (names, m.base_layer, [(m.lora_A[a], m.lora_B[a]) for a in names])
    w0 = m.base_layer.weight
    w = w0.T if m.fan_in_fan_out else w0
    acc = torch.float64 if torch.float64 in (w.dtype, *(t.dtype for t in m.parameters())) else torch.float32
    total = w.to(acc, copy=True)
    for a in names:
        total.addmm_(_local(m.lora_B[a].weight).to(acc), _local(m.lora_A[a].weight).to(acc), alpha=m.scaling[a])
    buf = m._buffers.get("merged_weight")
    if buf is not None and buf.shape == total.shape and buf.dtype == w0.dtype and buf.device == w0.device:
        buf.copy_(total)
    else:
        m.register_buffer("merged_weight", total.to(w0.dtype), persistent=False)
    m._gerl_stamp = _stamp(m)


def remerge(transformer, force: bool = False) -> int:
    """Re-merge the layers whose adapter changed (all with force=True). Returns how many were merged."""
    n = 0
    for m in transformer._gerl_merged_layers:
        if force or m._gerl_stamp != _stamp(m):
            _merge(m)
            n += 1
    return n


def _check(layers) -> None:
    for m in layers:
        base = m.base_layer
        linear = isinstance(base, nn.Linear) or (m.fan_in_fan_out and type(base).__name__ == "Conv1D")
        bad = ("it is not a plain linear" if type(m) is not LoraLinear or not linear else
               "its adapter is merged into W0 (merge_adapter)" if m.merged else
               "it has a LoRA variant (DoRA)" if m.lora_variant else
               "it has LoRA dropout" if any(not isinstance(d, nn.Identity) for d in m.lora_dropout.values()) else
               "it has a LoRA bias" if any(getattr(m, "lora_bias", {}).values()) else None)
        if bad:
            raise ValueError(f"model.merge_lora: cannot merge {type(m).__name__} ({bad}): the merged forward is "
                             "exactly W0 + s·B·A; set model.merge_lora=false")


def _remerge_hook(transformer, args) -> None:
    remerge(transformer)


def use_merged_lora(transformer) -> list:
    """Switch every adapted linear of `transformer` to the merged forward and install the re-merging hook on its
    root (idempotent). Returns the layers."""
    if is_merged(transformer):
        return transformer._gerl_merged_layers
    layers = lora_layers(transformer)
    if not layers:
        raise ValueError("model.merge_lora: the transformer has no LoRA adapter to merge")
    _check(layers)
    for m in layers:
        _merge(m)
        m.__class__ = MergedLoraLinear
    transformer._gerl_merged_layers = layers
    transformer.register_forward_pre_hook(_remerge_hook)
    return layers


def is_merged(transformer) -> bool:
    return hasattr(transformer, "_gerl_merged_layers")


def drop_merged_lora(transformer) -> None:
    """Back to PEFT's unmerged forward; the merged weights are freed."""
    if not is_merged(transformer):
        return
    for k, hook in list(transformer._forward_pre_hooks.items()):
        if hook is _remerge_hook:
            del transformer._forward_pre_hooks[k]
    for m in transformer.__dict__.pop("_gerl_merged_layers"):
        m.__class__ = LoraLinear
        del m._buffers["merged_weight"], m._gerl_stamp, m._gerl_parts


@contextmanager
def merged_lora(transformer):
    """`use_merged_lora` for the length of a block (nothing to undo when the transformer already merges)."""
    if is_merged(transformer):
        yield transformer._gerl_merged_layers
        return
    layers = use_merged_lora(transformer)
    try:
        yield layers
    finally:
        drop_merged_lora(transformer)
