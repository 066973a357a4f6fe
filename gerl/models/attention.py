"""model.attention_backend: the attention kernel of the transformer, chosen once where the pipeline is built, so that
the rollout and the training replay (the same module on a hybrid host, the same build on decoupled ones) run the same
kernel — the ratio of their log-probs is then 1 up to that kernel's own determinism.

gerl's names map to diffusers' attention dispatcher (`diffusers.models.attention_dispatch`, diffusers 0.42.1):
    sdpa   → native        torch's scaled_dot_product_attention, as the stock pipelines call it (the default: the
                           processors are left exactly as diffusers builds them)
    cudnn  → _native_cudnn torch's SDPA forced onto cuDNN attention (CUDA, fp16/bf16)
    flash  → flash         FlashAttention-2, the flash-attn package (CUDA, fp16/bf16, no attention mask)
    flash3 → _flash_3      FlashAttention-3, flash_attn_interface built from flash-attention's hopper/ (H100/H200)
Every choice but sdpa is probed at build time on the model's device and dtype, forward and backward, with a mask
when the family passes one: a backend that cannot run there is a one-line UserError at start-up naming the fix, not
a crash at the first denoising step.

SD3's stock processor (JointAttnProcessor2_0) calls F.scaled_dot_product_attention itself, which diffusers'
`set_attention_backend` silently skips; `JointAttnDispatchProcessor` below is that processor calling the dispatcher.
"""

from __future__ import annotations

import torch

from gerl.errors import UserError

BACKENDS = {"sdpa": "native", "cudnn": "_native_cudnn", "flash": "flash", "flash3": "_flash_3"}
NEEDS = {
    "cudnn": "a CUDA GPU whose torch has cuDNN attention (cuDNN ≥ 9, Ampere or newer) and model.dtype bf16 or fp16",
    "flash": "a CUDA GPU, model.dtype bf16 or fp16 and the flash-attn package (pip install flash-attn "
             "--no-build-isolation)",
    "flash3": "a Hopper GPU (H100/H200), model.dtype bf16 or fp16 and FlashAttention-3 (flash_attn_interface, built "
              "from flash-attention's hopper/ directory)",
}


class JointAttnDispatchProcessor:
    """diffusers' JointAttnProcessor2_0 (SD3's joint attention; SD3.5-M's second, image-only attention too) with
    F.scaled_dot_product_attention replaced by `dispatch_attention_fn`, whose backend `set_attention_backend`
    sets. The dispatcher takes (B, S, H, D); the stock processor transposes to (B, H, S, D) for SDPA."""

    _attention_backend = None
    _parallel_config = None

    # Copied from diffusers.models.attention_processor.JointAttnProcessor2_0.__call__ (diffusers 0.42.1) with the
    # attention call replaced and its transposes dropped
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim)  # (B, S, H, D)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:  # the text tokens follow the image tokens in one sequence
            ctx_q = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim)
            ctx_k = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim)
            ctx_v = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim)
            if attn.norm_added_q is not None:
                ctx_q = attn.norm_added_q(ctx_q)
            if attn.norm_added_k is not None:
                ctx_k = attn.norm_added_k(ctx_k)
            query = torch.cat([query, ctx_q], dim=1)
            key = torch.cat([key, ctx_k], dim=1)
            value = torch.cat([value, ctx_v], dim=1)
        hidden_states = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                              backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (hidden_states[:, : residual.shape[1]],
                                                    hidden_states[:, residual.shape[1]:])
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear, dropout
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def attention_processors(transformer) -> dict:
    """{module name: processor} of every attention module of `transformer`."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return {n: m.processor for n, m in transformer.named_modules() if isinstance(m, (Attention, AttentionModuleMixin))}


def _probe(backend: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, mask: bool) -> None:
    """One tiny attention forward and backward through the dispatcher, as the model will call it."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, heads, head_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    attn_mask = torch.ones(1, 8, dtype=torch.bool, device=device) if mask else None
    out = dispatch_attention_fn(q, k, v, attn_mask=attn_mask, backend=backend)
    out.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_attention_backend(transformer, name: str, family=None) -> str:
    """Route every attention of `transformer` to gerl's backend `name` (BACKENDS) on the transformer's device and
    dtype. Returns the dispatcher's backend name. sdpa leaves the stock processors untouched (today's numerics);
    any other name is probed first and raises a UserError naming what it needs when it cannot run here."""
    if name not in BACKENDS:
        raise UserError(f"model.attention_backend={name!r} is not one of {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if name == "sdpa":
        return backend
    if family is None:
        from gerl.models.family import family_of

        family = family_of(transformer)
    frozen = [p for p in transformer.parameters() if not p.requires_grad] or list(transformer.parameters())
    device, dtype = frozen[0].device, frozen[0].dtype
    cfg = transformer.config
    where = f"model.attention_backend={name} (diffusers' {backend} attention) cannot run on {device} in {dtype}"
    try:
        family.use_attention_dispatch(transformer)
        transformer.set_attention_backend(backend)  # raises when the backend's package is missing
        _probe(backend, device, dtype, cfg.num_attention_heads, cfg.attention_head_dim, family.attention_mask)
    except Exception as e:  # noqa: BLE001 — whatever the kernel says, the fix is the same: see NEEDS
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"{where} ({first}); it needs {NEEDS[name]}: fix that or set model.attention_backend=sdpa") \
            from None
    missed = [n for n, p in attention_processors(transformer).items()
              if getattr(p, "_attention_backend", None) != backend]
    if missed:  # a processor that calls its own attention: the backend would be half applied
        raise UserError(f"{where}: the {family.title} attention {missed[0]} does not call diffusers' dispatcher; use "
                        "model.attention_backend=sdpa")
    return backend
