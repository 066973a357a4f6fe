"""model.attention_backend (gerl/models/attention.py): sdpa leaves diffusers' processors as they are; any other
backend routes every attention through diffusers' dispatcher (SD3 through gerl's dispatching copy of its processor,
which computes what the stock one does and compiles as one graph) after a probe on the model's device; a backend that
cannot run there is a one-line error at build time, and one the config already rules out is a config error."""

from __future__ import annotations

import copy

import pytest
import torch

from gerl.config import Config, ModelConfig, EngineConfig, validate
from gerl.errors import UserError
from gerl.models import attention
from gerl.models.attention import JointAttnDispatchProcessor, attention_processors, set_attention_backend
from gerl.models.tiny import TOKEN_LENGTH


def _inputs(tr, b: int = 2):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(b, 16, 16, 16, generator=g), timestep=torch.full((b,), 400.0),
                encoder_hidden_states=torch.randn(b, 77 + TOKEN_LENGTH, tr.config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(b, tr.config.pooled_projection_dim, generator=g), return_dict=False)


def test_sdpa_leaves_the_stock_processors(tiny_pipe):
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    tr = copy.deepcopy(tiny_pipe.transformer)
    assert set_attention_backend(tr, "sdpa") == "native"
    assert all(type(p) is JointAttnProcessor2_0 for p in attention_processors(tr).values())


@pytest.mark.parametrize("name", ["cudnn", "flash", "flash3"])
def test_a_backend_that_cannot_run_here_is_one_line_naming_the_fix(tiny_pipe, name):
    tr = copy.deepcopy(tiny_pipe.transformer)
    with pytest.raises(UserError) as e:
        set_attention_backend(tr, name)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"model.attention_backend={name} ")
    assert "cpu" in msg and attention.NEEDS[name] in msg and "model.attention_backend=sdpa" in msg


def test_the_dispatching_sd3_processor_computes_what_the_stock_one_does_and_compiles_whole(tiny_pipe, monkeypatch):
    """Any backend but sdpa runs SD3 through JointAttnDispatchProcessor: on the CPU its native backend (torch's SDPA
    behind the dispatcher) must give the stock output, for the whole model and through torch.compile in one graph.
    `cudnn` mapped to the native backend exercises the whole non-sdpa path (dispatch, set, probe, check)."""
    from gerl.models.compile import CompileWatch, compile_transformer

    tr = copy.deepcopy(tiny_pipe.transformer)
    monkeypatch.setitem(attention.BACKENDS, "cudnn", "native")
    assert set_attention_backend(tr, "cudnn") == "native"
    procs = attention_processors(tr)
    assert procs and all(isinstance(p, JointAttnDispatchProcessor) and p._attention_backend == "native"
                         for p in procs.values())
    with torch.no_grad():
        stock = tiny_pipe.transformer(**_inputs(tr))[0]
        ours = tr(**_inputs(tr))[0]
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    try:
        compile_transformer(tr, variants=None, backend="eager")  # fullgraph: a break in the processor raises
        with torch.no_grad(), CompileWatch() as w:
            compiled = tr(**_inputs(tr))[0]
        assert w.counts["graphs"] == 2 and w.counts["graph_breaks"] == 0
        torch.testing.assert_close(compiled, ours, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_a_processor_the_dispatcher_does_not_reach_is_refused(tiny_pipe, monkeypatch):
    """The broken version: without gerl's processor, diffusers' set_attention_backend skips SD3's attention without a
    word (it calls SDPA itself) — the backend would be named in the config and never run."""
    from gerl.models.sd3 import SD3

    tr = copy.deepcopy(tiny_pipe.transformer)
    monkeypatch.setitem(attention.BACKENDS, "cudnn", "native")
    monkeypatch.setattr(SD3, "use_attention_dispatch", lambda self, transformer: None)
    with pytest.raises(UserError, match="does not call diffusers' dispatcher"):
        set_attention_backend(tr, "cudnn")


def test_build_pipeline_probes_the_backend_on_the_device(monkeypatch):
    """build_pipeline, where the device is known, refuses a backend the device cannot run — before any step."""
    from gerl.engine.roles import build_pipeline

    cfg = Config(model=ModelConfig(attention_backend="flash", dtype="bf16", device="cpu"))
    with pytest.raises(UserError, match="model.attention_backend=flash .*cannot run on cpu"):
        build_pipeline(cfg, roles=("actor",))


@pytest.mark.parametrize("overrides,error", [
    (dict(model=ModelConfig(attention_backend="flash")), "model.attention_backend=flash computes in bf16/fp16 only"),
    (dict(model=ModelConfig(attention_backend="cudnn", dtype="bf16", device="cpu")), "needs a CUDA GPU"),
    (dict(model=ModelConfig(attention_backend="flash3", dtype="bf16"), engine=EngineConfig(device="cpu")),
     "needs a CUDA GPU"),
    (dict(model=ModelConfig(compile=True, dtype="fp16"), engine=EngineConfig(rehearse=True, kind="ray")),
     "model.compile=true with an fp16 rehearsal"),
])
def test_combinations_that_cannot_work_are_config_errors(overrides, error):
    errors = validate(Config(**overrides))
    assert any(error in e for e in errors), errors


def test_the_speed_levers_are_described(tmp_path):
    from gerl.config import to_dict
    from gerl.logging.describe import speed

    assert speed({}) == "attention sdpa, eager"  # a config.yaml from before these keys: the defaults
    cfg = Config(model=ModelConfig(compile=True, attention_backend="flash3", dtype="bf16"))
    assert speed(to_dict(cfg)) == "attention flash3, compiled blocks"
