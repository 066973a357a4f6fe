"""The reward registry: names, module:callable, entry points, kwargs checks, return-shape normalisation, pickling."""

import asyncio
import multiprocessing
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import pytest
from PIL import Image

from gerl.errors import UserError
from rewards import (
    build_reward,
    call_reward,
    is_reward_factory,
    register,
    registered_names,
    reward_factory,
    validate_reward_inputs,
)
from rewards import registry

IMAGES = [Image.new("RGB", (16, 16), c) for c in ("white", "black", "red")]
PROMPTS = ["a", "b", "c"]
META = [{}, {}, {}]


# Module-level so that `tests_module:callable` names resolve and the objects pickle.
class Constant:
    def __init__(self, value: float = 1.0):
        self.value = value

    def __call__(self, images, prompts, metadata):
        return [self.value] * len(images)


def plain_reward(images, prompts, metadata):
    return [float(i) for i in range(len(images))]


def plain_factory(value: float = 2.0):
    return Constant(value)


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_builtins_are_registered():
    assert {"ocr", "jpeg_compressibility", "jpeg_incompressibility"} <= set(registered_names())


def test_register_decorator_builds_with_kwargs(clean_registry):
    @register("test_const")
    def factory(value: float = 0.5):
        return Constant(value)

    reward = build_reward("test_const", {"value": 3.0})
    assert call_reward(reward, IMAGES, PROMPTS, META) == ([3.0, 3.0, 3.0], {})
    assert "test_const" in registered_names()


def test_duplicate_name_is_rejected(clean_registry):
    register("test_dup")(plain_factory)
    with pytest.raises(ValueError, match="already registered"):
        register("test_dup")(Constant)


def test_factory_or_reward_rule():
    assert is_reward_factory(Constant)  # a class: instances are the rewards
    assert is_reward_factory(plain_factory)  # a function without an `images` parameter
    assert not is_reward_factory(plain_reward)  # has `images`: it is the reward
    assert not is_reward_factory(Constant())  # a callable instance is a reward

    def images_named_factory(images: int = 1):  # an `images` kwarg, but marked: the explicit marker wins
        return Constant(images)

    assert is_reward_factory(reward_factory(images_named_factory))


def test_module_callable_paths():
    module = __name__
    assert call_reward(build_reward(f"{module}:plain_reward", {}), IMAGES, PROMPTS, META)[0] == [0.0, 1.0, 2.0]
    assert call_reward(build_reward(f"{module}:plain_factory", {}), IMAGES, PROMPTS, META)[0] == [2.0] * 3
    assert call_reward(build_reward(f"{module}:Constant", {"value": 7}), IMAGES, PROMPTS, META)[0] == [7.0] * 3
    with pytest.raises(UserError, match="takes no kwargs"):
        build_reward(f"{module}:plain_reward", {"value": 1})
    with pytest.raises(UserError, match="cannot import module 'no_such_module_xyz'"):
        build_reward("no_such_module_xyz:fn", {})
    with pytest.raises(UserError, match="has no attribute 'missing'"):
        build_reward(f"{module}:missing", {})


def test_unknown_name_lists_names_and_closest_match():
    with pytest.raises(UserError) as info:
        build_reward("orc", {})
    message = str(info.value)
    assert "did you mean 'ocr'" in message
    assert "jpeg_compressibility" in message and "\n" not in message


def test_bad_kwargs_name_the_key_and_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown kwargs \['rec_onyl'\].*rec_only.*det_limit_side_len"):
        build_reward("ocr", {"rec_onyl": True})
    with pytest.raises(UserError, match=r"unknown kwargs \['quality'\]; valid kwargs: \(none\)"):
        build_reward("jpeg_compressibility", {"quality": 80})


def test_missing_required_kwarg(clean_registry):
    register("test_needs")(lambda scale: Constant(scale))
    with pytest.raises(UserError, match=r"needs kwargs \['scale'\]"):
        build_reward("test_needs", {})


def test_entry_point(tmp_path, monkeypatch):
    """A third-party package advertising a reward in the gerl.rewards group, via a real dist-info on sys.path."""
    (tmp_path / "gerl_plugin_demo.py").write_text(textwrap.dedent("""
        class Half:
            def __call__(self, images, prompts, metadata):
                return [0.5] * len(images)

        def make_half():
            return Half()
    """))
    dist = tmp_path / "gerl_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gerl-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gerl.rewards]\nhalf = gerl_plugin_demo:make_half\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert "half" in registered_names()
    assert call_reward(build_reward("half", {}), IMAGES, PROMPTS, META)[0] == [0.5] * 3
    sys.modules.pop("gerl_plugin_demo", None)


def test_call_reward_normalises_shapes():
    as_tuple = lambda i, p, m: ([1, None, 3], {"note": ["x", "y", "z"]})  # noqa: E731
    assert call_reward(as_tuple, IMAGES, PROMPTS, META) == ([1.0, None, 3.0], {"note": ["x", "y", "z"]})
    as_tuple_of_floats = lambda i, p, m: (1.0, 2.0, 3.0)  # noqa: E731  (a tuple of scores, not (scores, extras))
    assert call_reward(as_tuple_of_floats, IMAGES, PROMPTS, META) == ([1.0, 2.0, 3.0], {})

    async def async_reward(images, prompts, metadata):
        await asyncio.sleep(0)
        return [0.25] * len(images)

    assert call_reward(async_reward, IMAGES, PROMPTS, META) == ([0.25] * 3, {})


def test_call_reward_rejects_wrong_shapes():
    with pytest.raises(UserError, match="returned 2 scores for 3 images"):
        call_reward(lambda i, p, m: [1.0, 2.0], IMAGES, PROMPTS, META)
    with pytest.raises(UserError, match="extra 'note' has 1 entries for 3 images"):
        call_reward(lambda i, p, m: ([1.0] * 3, {"note": ["x"]}), IMAGES, PROMPTS, META)
    with pytest.raises(UserError, match="list of floats"):
        call_reward(lambda i, p, m: ["high", "low", "mid"], IMAGES, PROMPTS, META)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_rewards_survive_a_process_pool(context):
    """Rewards are shipped to worker processes; a fresh interpreter must rebuild them and score identically."""
    from PIL import ImageDraw, ImageFont

    image = Image.new("RGB", (128, 64), "white")
    ImageDraw.Draw(image).text((10, 20), "Hello", fill="black", font=ImageFont.load_default(size=20))
    images, prompts, meta = [image, IMAGES[0]], ['"Hello"', '"Hello"'], [{}, {}]
    rewards = [build_reward("ocr", {}), build_reward("jpeg_compressibility", {}), Constant(4.0)]
    local = [call_reward(r, images, prompts, meta) for r in rewards]

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context(context)) as pool:
        remote = [pool.submit(call_reward, r, images, prompts, meta).result(timeout=120) for r in rewards]
    assert remote == local
    assert local[0][0][0] >= 0.95  # the OCR reward really read the text in the worker too


@pytest.mark.parametrize("name", ["ocr", "jpeg_compressibility", "jpeg_incompressibility"])
def test_builtin_reward_contract(name):
    """Every built-in: one float per image, deterministic, picklable, and validate() accepts quoted prompts."""
    import pickle

    reward = build_reward(name, {})
    prompts = ['"Hi"', '"there"', '"you"']
    validate_reward_inputs(reward, prompts, META)
    scores, extras = call_reward(reward, IMAGES, prompts, META)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert all(len(v) == 3 for v in extras.values())
    assert call_reward(pickle.loads(pickle.dumps(reward)), IMAGES, prompts, META) == (scores, extras)
