"""model.merge_lora (gerl/models/lora_merge.py): each adapted linear computes x·W_mᵀ with W_m = W0 + s·B·A merged
in the model dtype, and differentiates that formula for A and B; W_m follows the adapter's tensors; the adapters
off compute exactly W0·x."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from gerl.models import lora_merge
from gerl.models.lora_merge import drop_merged_lora, merged_lora, use_merged_lora


class One(nn.Module):
    def __init__(self, inp: int, out: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(inp, out, bias=bias)

    def forward(self, x):
        return self.proj(x)


def _layer(inp, out, r, alpha, dtype=torch.bfloat16, adapters=("default",), bias=True):
    """A model of one LoRA linear: base in `dtype`, adapters in fp32 (as gerl trains them)."""
    model = One(inp, out, bias)
    for name in adapters:
        model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"]), model,
                                        adapter_name=name)
    model.to(dtype)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    model.proj.set_adapter(list(adapters))
    return model


def test_the_backward_by_hand_on_integers():
    """W0 (2×3), r = 1, s = α/r = 2: every value is a small integer, exact in bf16 and fp32, so the gradients are
    the hand-computed ones exactly: W_m = W0 + 2·B·A, dx = dy·W_m, dB = s·dyᵀ(x·Aᵀ), dA = s·(dy·B)ᵀx."""
    model = _layer(3, 2, r=1, alpha=2.0)
    layer = model.proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor([[1.0, 2, 0], [0, 1, -1]]))
        layer.base_layer.bias.copy_(torch.tensor([1.0, -1]))
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, 0, 1]]))
        layer.lora_B["default"].weight.copy_(torch.tensor([[1.0], [2]]))
    x = torch.tensor([[1.0, 1, 1], [2, 0, 1]], dtype=torch.bfloat16, requires_grad=True)
    use_merged_lora(model)
    assert torch.equal(layer.merged_weight, torch.tensor([[3.0, 2, 2], [4, 1, 3]], dtype=torch.bfloat16))
    y = model(x)
    assert torch.equal(y, torch.tensor([[8.0, 7], [9, 10]], dtype=torch.bfloat16))
    y.backward(torch.tensor([[1.0, 0], [0, 1]], dtype=torch.bfloat16))
    assert torch.equal(x.grad, torch.tensor([[3.0, 2, 2], [4, 1, 3]], dtype=torch.bfloat16))
    assert torch.equal(layer.lora_B["default"].weight.grad, torch.tensor([[4.0], [6]]))
    assert torch.equal(layer.lora_A["default"].weight.grad, torch.tensor([[10.0, 2, 6]]))
    assert layer.base_layer.weight.grad is None and layer.base_layer.bias.grad is None  # W0 frozen


def test_the_backward_is_autograd_of_the_fp32_formula_for_every_active_adapter():
    """Two active adapters, (2, 5, 16) inputs: dA, dB (fp32) equal autograd of y = x·(W0 + Σ s·B·A)ᵀ + b computed
    unrounded in fp32 from the same bf16 x and dy; dx is that formula's dx rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    model = _layer(16, 12, r=4, alpha=8.0, adapters=("default", "other"))
    layer = model.proj
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    scalings = {a: layer.scaling[a] for a in ("default", "other")}
    assert scalings == {"default": 2.0, "other": 2.0}
    x = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(2, 5, 12, generator=g).to(torch.bfloat16)

    # the reference: autograd through the formula itself, in fp32
    ab = {a: (layer.lora_A[a].weight.detach().clone().requires_grad_(True),
              layer.lora_B[a].weight.detach().clone().requires_grad_(True)) for a in scalings}
    xr = x.detach().float().requires_grad_(True)
    w = layer.base_layer.weight.float() + sum(scalings[a] * b @ a_ for a, (a_, b) in ab.items())
    torch.nn.functional.linear(xr, w, layer.base_layer.bias.float()).backward(dy.float())

    use_merged_lora(model)
    assert torch.equal(layer.merged_weight, w.detach().to(torch.bfloat16))  # the exact sum, rounded once
    model(x).backward(dy)
    for a, (a_ref, b_ref) in ab.items():
        torch.testing.assert_close(layer.lora_A[a].weight.grad, a_ref.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.lora_B[a].weight.grad, b_ref.grad, rtol=1e-5, atol=1e-6)
        assert layer.lora_A[a].weight.grad.dtype == torch.float32
    # dx goes through W_m (bf16): the fp32 formula's dx within bf16 rounding of W_m and of the result
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-2, atol=2e-2)


def test_fan_in_fan_out_layers_merge_the_transposed_update():
    """A Conv1D base (transformers' GPT-2 layers: weight (in, out), y = x·W + b): W_m is built transposed."""
    from transformers.pytorch_utils import Conv1D

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(6, 4)  # (nf=out, nx=in)

        def forward(self, x):
            return self.c_attn(x)

    g = torch.Generator().manual_seed(1)
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2.0, target_modules=["c_attn"], fan_in_fan_out=True),
                                    Gpt())
    layer = model.c_attn
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 4, generator=g)
    with torch.no_grad():
        peft = model(x)
    w0 = layer.base_layer.weight  # (in, out)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    use_merged_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), x @ (w0 + (b @ a).T) + layer.base_layer.bias)
        torch.testing.assert_close(model(x), peft, rtol=1e-5, atol=1e-5)


def _forward(tr, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    dtype = next(tr.parameters()).dtype
    x = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g).to(dtype)
    enc = torch.randn(2, 8, cfg.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g).to(dtype)
    return tr(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=torch.tensor([500.0, 300]),
              return_dict=False)[0]


def _expected_merged(layer) -> torch.Tensor:
    a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
    w0 = layer.base_layer.weight
    return (w0.float() + layer.scaling["default"] * b @ a).to(w0.dtype)


def test_an_optimizer_step_is_merged_before_the_next_forward(lora_transformer, monkeypatch):
    """After an AdamW step on the adapter, each W_m is the new W0 + s·B·A and the output is that of a transformer
    merged from scratch with the new adapter; without the re-merging hook the stale W_m would still be used."""
    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    layers = use_merged_lora(tr)
    before = [m.merged_weight.clone() for m in layers]
    opt = torch.optim.AdamW([p for p in tr.parameters() if p.requires_grad], lr=1e-2)
    _forward(tr).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        after = _forward(tr, seed=1)
    for m in layers:
        assert torch.equal(m.merged_weight, _expected_merged(m))
    assert sum(not torch.equal(m.merged_weight, w) for m, w in zip(layers, before)) == len(layers)  # all moved
    fresh = copy.deepcopy(tr)
    drop_merged_lora(fresh)
    use_merged_lora(fresh)  # merged from scratch from the stepped adapter
    with torch.no_grad():
        assert torch.equal(_forward(fresh, seed=1), after)

    # the broken version: the hook that re-merges dropped → the next step's output is stale
    monkeypatch.setattr(lora_merge, "remerge", lambda transformer, force=False: 0)
    _forward(tr).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        assert not all(torch.equal(m.merged_weight, _expected_merged(m)) for m in layers)


def test_replaced_and_copied_adapter_tensors_are_merged(lora_transformer):
    """`p.data = …` (a new storage, the version counter kept), an in-place copy_ (EMA/anchor swaps, staged and
    synced weights, a resume) and a tensor set on the module: each is merged before the next forward."""
    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    layers = use_merged_lora(tr)
    layer = layers[0]
    b = layer.lora_B["default"]
    g = torch.Generator().manual_seed(3)
    for change in ("data", "copy", "param"):
        new = torch.randn(b.weight.shape, generator=g)
        if change == "data":
            b.weight.data = new
        elif change == "copy":
            with torch.no_grad():
                b.weight.copy_(new)
        else:
            b.weight = nn.Parameter(new)
        with torch.no_grad():
            _forward(tr)
        assert torch.equal(layer.merged_weight, _expected_merged(layer)), change


def test_adapters_disabled_compute_exactly_the_base_model(tiny_pipe, lora_transformer):
    """disable_adapters() (the KL reference policy, DGPO's base): exactly the transformer without any adapter."""
    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    use_merged_lora(tr)
    base = copy.deepcopy(tiny_pipe.transformer).to(torch.bfloat16)
    with torch.no_grad():
        merged = _forward(tr)
        tr.disable_adapters()
        off = _forward(tr)
        tr.enable_adapters()
        again = _forward(tr)
        assert torch.equal(off, _forward(base))
    assert (merged.float() - off.float()).abs().max() > 1e-2  # the adapter matters here
    assert torch.equal(again, merged)


def test_merging_changes_no_export_and_is_undone(lora_transformer):
    """The merged weights are no state: state_dict, the LoRA export and W0 are unchanged; dropping the merge gives
    PEFT's unmerged forward back bit for bit."""
    from gerl.models.loader import lora_state_dict

    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    with torch.no_grad():
        peft = _forward(tr)
    state, lora = tr.state_dict(), lora_state_dict(tr)
    with merged_lora(tr) as layers:
        assert len(layers) == 8 and all(type(m).__name__ == "MergedLoraLinear" for m in layers)
        assert tr.state_dict().keys() == state.keys()
        assert all(torch.equal(tr.state_dict()[k], state[k]) for k in state)
        assert lora_state_dict(tr).keys() == lora.keys()
        with torch.no_grad():
            assert not torch.equal(_forward(tr), peft)  # bf16: one rounding of W0 + s·B·A differs from PEFT's sum
    assert not any(hasattr(m, "merged_weight") for m in tr.modules())
    with torch.no_grad():
        assert torch.equal(_forward(tr), peft)


def test_no_grad_and_training_forwards_are_bitwise_equal(lora_transformer):
    """The rollout (no grad, eval) and the training replay (grad, train mode) compute the same tensor."""
    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    use_merged_lora(tr)
    with torch.no_grad():
        tr.eval()
        rollout = _forward(tr)
    tr.train()
    replay = _forward(tr)
    assert replay.requires_grad and torch.equal(replay, rollout)


def test_what_cannot_be_merged_exactly_is_refused():
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2.0, target_modules=["proj"], lora_dropout=0.1),
                                    One(4, 4))
    with pytest.raises(ValueError, match="LoRA dropout"):
        use_merged_lora(model)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        use_merged_lora(One(4, 4))


def test_a_compiled_block_runs_the_merged_layers_in_one_graph_and_follows_a_re_merge(lora_transformer):
    """Regional compile (each transformer block) with the merged layers inside: no graph break (fullgraph), the
    eager values and gradients, and after an update of the adapter the re-merged weights are read without a
    recompile (the re-merge writes W_m in place, outside the compiled blocks)."""
    import torch._dynamo

    tr = lora_transformer(randomize=True, dtype=torch.bfloat16)
    use_merged_lora(tr)
    eager_twin = copy.deepcopy(tr)

    def value_and_grads(model):
        with torch.no_grad():
            rollout = _forward(model)
        _forward(model).float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        return rollout, grads

    def update(model):
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.01)

    torch._dynamo.reset()
    for block in tr.transformer_blocks:
        block.compile(fullgraph=True, backend="aot_eager")
    compiled, compiled_grads = value_and_grads(tr)
    eager, eager_grads = value_and_grads(eager_twin)
    assert torch.equal(compiled, eager) and all(torch.equal(a, b) for a, b in zip(compiled_grads, eager_grads))
    update(tr)
    update(eager_twin)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        moved = _forward(tr)
        assert torch.equal(moved, _forward(eager_twin)) and not torch.equal(moved, compiled)
