"""model.compile (gerl/models/compile.py) on the tiny SD3, in the style of diffusers' compile tester: every block
compiled in place, one graph per block call, each distinct block call (grad mode × batch rows × adapter on/off)
compiled once in a training run's first step and nothing compiled in its second (`error_on_recompile`), the rollout
and the actor running the same compiled blocks, and a graph break or a shape that changes every call caught.

The dynamo-level tests compile with aot_eager (tracing, AOT autograd and its backward, no code generation: the
guards, graph breaks and recompilations are dynamo's whatever the backend); the inductor test (the ratio to 1e-6,
gradient checkpointing) is the one that pays for C++ code generation.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch._dynamo

from gerl.config import Config, ModelConfig, SamplingConfig, TrainConfig, ValidationConfig
from gerl.models.compile import CompileWatch, compile_transformer, take_compile_metrics, variant_bound
from gerl.models.family import family_of
from gerl.workers.actor import ActorWorker

PROMPTS = ["a red cat", "a red cat", "hello 42", "hello 42"]
GROUPS = torch.tensor([0, 0, 1, 1])
# CFG (guidance 3: SD3 doubles the batch), rollout micro-batch 2 → 4 rows; training micro-batch 1 → 2 rows; every
# step but the last recorded (2 of 3); validation: 3 images at guidance 1 in chunks of 2 and 1
SAMPLING = SamplingConfig(sampler="cps", num_steps=3, noise_level=0.7, sde_window_size=0, guidance_scale=3.0,
                          eval_guidance_scale=1.0, micro_batch_size=2)
TRAIN = TrainConfig(micro_batch_size=1, learning_rate=1e-3, recompute_old_log_probs=True, beta=0.01)
CFG = Config(sampling=SAMPLING, train=TRAIN, validation=ValidationConfig(num_prompts=3))
# The distinct block calls of one step of CFG, each a graph per block structure (the tiny SD3 has 2: a joint block
# and the last, text-output-free one):
VARIANTS = {
    "rollout": ("no grad", 4, "adapter on"),  # 2 samples × CFG
    "training": ("grad", 2, "adapter on"),  # 1 sample × CFG
    "old log-probs, validation's first chunk": ("no grad", 2, "adapter on"),  # recompute_old_log_probs; 2 × no CFG
    "KL reference": ("no grad", 2, "adapter off"),  # train.beta > 0: the adapter disabled
    "validation's last chunk": ("no grad", 1, "adapter on"),
}
STRUCTURES = 2


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Dynamo's caches live on the block class's code, shared by every compiled block of the process: start and
    leave this module with none, and with dynamo's limits as they were."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=False):
        yield
    torch._dynamo.reset()


def counting(calls: collections.Counter):
    """aot_eager whose compiled graphs count their runs by grad mode: proof that a caller ran the compiled blocks."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            calls["grad" if torch.is_grad_enabled() else "no grad"] += 1
            return compiled(*args)

        return run

    return backend


@pytest.fixture(scope="module")
def compiled(tiny_pipe):
    """A LoRA copy of the tiny transformer (B ≠ 0: the adapter matters) compiled as build_pipeline does, the runs
    of its compiled graphs counted."""
    from gerl.models.loader import add_lora

    tr = copy.deepcopy(tiny_pipe.transformer)
    add_lora(tr, 4, 8.0, ["to_q", "to_k", "to_v", "to_out.0"])
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    keys = list(tr.state_dict())
    calls = collections.Counter()
    info = compile_transformer(tr, variants=variant_bound(CFG, family_of(tr)), backend=counting(calls))
    return tr, info, keys, calls


def _step(make_rollout, tr, actor, step: int):
    rollout = make_rollout(SAMPLING, tr)
    batch = rollout.generate(PROMPTS, [{}] * 4, GROUPS, step=step)
    metrics = actor.update(batch, torch.tensor([1.0, -1.0, -1.0, 1.0]), step=step)
    rollout.sample_images(PROMPTS[:3], seed=5, num_steps=2, guidance=SAMPLING.eval_guidance_scale)
    return metrics


def test_every_block_is_compiled_in_place_and_the_limit_is_explicit(compiled):
    tr, info, keys, _ = compiled
    assert info["compiled_blocks"] == len(tr.transformer_blocks) == 2
    assert info["block_lists"] == {"transformer_blocks": 2} and info["structures"] == {"JointTransformerBlock": 2}
    assert all(b._compiled_call_impl is not None for b in tr.transformer_blocks)
    assert list(tr.state_dict()) == keys, "checkpoints, LoRA exports and weight sync see the same keys"
    assert not any("_orig_mod" in k for k in keys)
    bound = variant_bound(CFG, family_of(tr))
    assert bound >= len(VARIANTS)
    assert info["recompile_limit"] == STRUCTURES * bound == torch._dynamo.config.recompile_limit
    assert torch._dynamo.config.fail_on_recompile_limit_hit


def test_a_training_run_compiles_each_block_call_once_and_never_again(compiled, make_rollout):
    tr, _, _, calls = compiled
    actor = ActorWorker(tr, TRAIN, ModelConfig(lora=True), SAMPLING, max_steps=2, images_per_step=4, seed=0)
    take_compile_metrics("test")
    with CompileWatch() as warm:
        _step(make_rollout, tr, actor, step=1)
    first = take_compile_metrics("actor")
    assert warm.counts["graph_breaks"] == 0
    assert warm.counts["graphs"] == STRUCTURES * len(VARIANTS), warm.counts
    assert first["actor_graphs_compiled"] == STRUCTURES * len(VARIANTS) and first["actor_compile_s"] > 0
    # The second step: every shape, grad mode and adapter state again; any recompilation raises here.
    before = dict(calls)
    with torch._dynamo.config.patch(error_on_recompile=True), CompileWatch() as again:
        metrics = _step(make_rollout, tr, actor, step=2)
    assert again.counts == {**again.counts, "graphs": 0, "graph_breaks": 0}
    assert take_compile_metrics("actor") == {"actor_compile_s": 0.0, "actor_graphs_compiled": 0}
    # the rollout (no grad) and the actor's training forward (grad) both ran the compiled blocks
    assert calls["grad"] > before.get("grad", 0) and calls["no grad"] > before.get("no grad", 0)
    assert metrics["ratio_max_dev_before_update"] <= 1e-6 and metrics["old_log_prob_recompute_max_dev"] <= 1e-6


def test_an_actor_on_an_uncompiled_copy_runs_no_compiled_graph(compiled, make_rollout, tiny_pipe):
    """The broken version of the test above: a rollout compiled, its actor eager. The count says so (the ratio in
    fp32 would not: eager and compiled blocks agree to rounding)."""
    tr, _, _, calls = compiled
    eager = copy.deepcopy(tr)  # Module.__getstate__ drops the compiled call: this copy runs eager
    assert all(b._compiled_call_impl is None for b in eager.transformer_blocks)
    batch = make_rollout(SAMPLING, tr).generate(PROMPTS, [{}] * 4, GROUPS, step=3)
    train = TrainConfig(micro_batch_size=1, learning_rate=1e-3)
    actor = ActorWorker(eager, train, ModelConfig(lora=True), SAMPLING, max_steps=1, images_per_step=4, seed=0)
    before = calls["grad"]
    actor.update(batch, torch.tensor([1.0, -1.0, -1.0, 1.0]), step=3)
    assert calls["grad"] == before


def test_a_shape_that_changes_every_call_is_a_recompile_and_then_an_error(compiled, tiny_pipe):
    """The broken loop: a batch that grows each call. After warm-up `error_on_recompile` names the first new shape;
    in a run, the explicit limit stops it instead of letting blocks fall back to eager."""
    from gerl.sampling.loop import Embeds, predict_velocity

    tr, info, _, _ = compiled
    torch.manual_seed(0)

    def call(b: int):
        x, t = torch.randn(b, 16, 16, 16), torch.full((b,), 500.0)
        emb = Embeds(torch.randn(b, 64, 64), torch.randn(b, tr.config.pooled_projection_dim))
        with torch.no_grad():
            predict_velocity(tr, x, t, emb, 1.0)

    call(3)  # a shape of its own: compiled once
    with CompileWatch() as w:
        call(3)
    assert w.counts["graphs"] == 0
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(torch._dynamo.exc.RecompileError):
        call(5)
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit), \
            pytest.raises(Exception, match="recompile_limit|cache_size_limit|fail_on_recompile_limit_hit"):
        torch._dynamo.config.recompile_limit = 1  # as if the run's bound were reached
        call(6)


def test_build_pipeline_compiles_after_the_adapter_is_attached():
    """Where gerl builds the model both roles call: the adapter's layers are inside the compiled blocks."""
    from gerl.engine.roles import build_pipeline

    cfg = Config(model=ModelConfig(compile=True))
    tr = build_pipeline(cfg, roles=("actor",)).transformer
    assert all(b._compiled_call_impl is not None for b in tr.transformer_blocks)
    assert any("lora_A" in n for n, _ in tr.transformer_blocks[0].named_parameters())
    assert torch._dynamo.config.recompile_limit == STRUCTURES * variant_bound(cfg, family_of(tr))
    assert build_pipeline(Config(), roles=("actor",)).transformer.transformer_blocks[0]._compiled_call_impl is None


def test_the_frozen_reference_of_full_fine_tuning_is_compiled_too(tiny_pipe):
    """A deep copy drops the compiled blocks (Module.__getstate__): the KL reference of full fine-tuning would run
    eager beside a compiled policy unless the actor compiles it."""
    tr = copy.deepcopy(tiny_pipe.transformer)
    compile_transformer(tr, variants=None, backend="eager")
    model = ModelConfig(lora=False, compile=True)
    actor = ActorWorker(tr, TrainConfig(beta=0.01), model, SAMPLING, max_steps=1, images_per_step=4, seed=0)
    assert actor.ref is not tr and all(b._compiled_call_impl is not None for b in actor.ref.transformer_blocks)


def test_a_family_whose_shapes_change_per_batch_is_refused():
    from gerl.errors import UserError
    from gerl.models.family import families

    qwen = families()["qwenimage"]
    with pytest.raises(UserError, match="model.compile=true cannot keep Qwen-Image's shapes fixed: its text length"):
        compile_transformer(torch.nn.Linear(1, 1), qwen)


def test_a_graph_break_in_a_block_is_an_error_or_is_counted(tiny_pipe, monkeypatch):
    """The other broken version: a block that breaks its graph (here a print) fails at its first call with
    fullgraph=True; without it, CompileWatch counts the break."""
    from diffusers.models.attention import JointTransformerBlock

    forward = JointTransformerBlock.forward

    def breaking(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    def run(fullgraph: bool):
        torch._dynamo.reset()  # the entries of the fixture's module live on the same code
        tr = copy.deepcopy(tiny_pipe.transformer)
        compile_transformer(tr, variants=None, backend="eager", fullgraph=fullgraph)
        monkeypatch.setattr(JointTransformerBlock, "forward", breaking)
        try:
            with torch.no_grad(), CompileWatch() as w:
                tr(hidden_states=torch.randn(1, 16, 16, 16), timestep=torch.tensor([500.0]),
                   encoder_hidden_states=torch.randn(1, 64, 64),
                   pooled_projections=torch.randn(1, tr.config.pooled_projection_dim), return_dict=False)
        finally:
            monkeypatch.setattr(JointTransformerBlock, "forward", forward)
        return w.counts

    with pytest.raises(torch._dynamo.exc.Unsupported):
        run(fullgraph=True)
    assert run(fullgraph=False)["graph_breaks"] > 0
    torch._dynamo.reset()


@pytest.mark.slow  # inductor's C++ code generation: 6 graphs, 1–2.5 min cold on 2 busy cores, ~15 s from its cache
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32 too, when run by hand: the suite's time keeps one dtype
def test_inductor_rollout_and_replay_agree_to_1e_6_with_and_without_gradient_checkpointing(tiny_pipe, make_rollout,
                                                                                          dtype):
    """Through inductor on the CPU: the compiled rollout's log-probs and the compiled actor's replay at the same
    weights give max |ratio − 1| ≤ 1e-6 — in bf16, where the rollout's no-grad graph and the training graph (two
    compilations of one block) only agree because every bf16 intermediate is rounded as eager rounds it
    (emulate_precision_casts; without it 8.7e-3; fp32, the other parametrisation, 2.4e-7); the compiled blocks ran
    (the graphs counted; in fp32 their output also differs from eager's); and gradient checkpointing recomputes each
    block through the same compiled training graph — nothing more compiles, the gradients are the same."""
    from gerl.models.loader import add_lora

    torch._dynamo.reset()
    tr = copy.deepcopy(tiny_pipe.transformer).to(dtype)
    add_lora(tr, 4, 8.0, ["to_q", "to_k", "to_v", "to_out.0"])  # the adapter's weights stay fp32
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    eager = copy.deepcopy(tr)
    sampling = SamplingConfig(sampler="cps", num_steps=3, noise_level=0.7, sde_window_size=0, micro_batch_size=2)
    train = TrainConfig(micro_batch_size=2, learning_rate=1e-3)
    compile_transformer(tr, variants=variant_bound(Config(sampling=sampling, train=train), family_of(tr)))
    actor = ActorWorker(tr, train, ModelConfig(lora=True), sampling, max_steps=3, images_per_step=4, seed=0)
    with CompileWatch() as warm:
        batch = make_rollout(sampling, tr).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
        metrics = actor.update(batch, torch.tensor([1.0, -1.0, -1.0, 1.0]), step=1)
    assert warm.counts["graphs"] == STRUCTURES * 2 and warm.counts["graph_breaks"] == 0  # no grad and grad
    assert metrics["ratio_max_dev_before_update"] <= 1e-6
    ref = make_rollout(sampling, eager).generate(PROMPTS, [{}] * 4, GROUPS, step=1)
    if dtype == torch.float32:  # (in bf16 the emulated roundings can make them equal)
        assert not torch.equal(ref.traj.final_latents, batch.traj.final_latents), "the rollout ran eager blocks"
    torch.testing.assert_close(ref.traj.final_latents, batch.traj.final_latents, rtol=1e-2, atol=1e-2)

    # Gradient checkpointing: the same loss's gradient, recomputing each block in backward, compiles nothing new.
    from gerl.sampling.loop import replay_log_prob

    def grads():
        tr.zero_grad(set_to_none=True)
        t = batch.traj
        idx, k = torch.arange(2), torch.tensor([0, 1])
        out = replay_log_prob(tr, t.latents[idx, k], t.next_latents[idx, k], t.steps_of(idx, k),
                              batch.embeds.index(idx), batch.schedule, sampling.sampler, sampling.noise_level, 1.0)
        out.log_prob.sum().backward()
        return {n: p.grad.clone() for n, p in tr.named_parameters() if p.grad is not None}

    tr.train()
    plain = grads()
    tr.enable_gradient_checkpointing()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True), CompileWatch() as ckpt:
            recomputed = grads()
    finally:
        tr.disable_gradient_checkpointing()
    assert ckpt.counts["graphs"] == 0 and len(recomputed) == len(plain) > 0
    for n in plain:
        torch.testing.assert_close(recomputed[n], plain[n], rtol=0, atol=0, msg=n)
    torch._dynamo.reset()
