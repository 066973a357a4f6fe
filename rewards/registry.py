"""Reward plug-ins: a name -> factory registry, and the one way the trainer calls a reward.

A *reward* is a plain callable::

    fn(images: list[PIL.Image.Image], prompts: list[str], metadata: list[dict])
        -> list[float | None]                          # one score per image; None = not applicable
         | tuple[list[float | None], dict[str, list]]  # ... plus per-sample extras for logging

A *factory* builds a reward from keyword arguments (the `reward.kwargs` of a config)::

    @register("my_reward")
    def my_reward(scale: float = 1.0) -> RewardFn:
        return MyReward(scale)

Factories must be cheap: they return an instance of a module-level class that only holds its arguments and loads
any model on its first `__call__`. That keeps the reward picklable, so it can be shipped to worker processes
(`ProcessPoolExecutor` with the 'spawn' / 'forkserver' context) and each process loads its own model.

A reward object may also define `validate(prompts, metadata) -> None`, raising `UserError` for inputs it can
never score; the trainer calls it once over the whole dataset at start-up (`validate_reward_inputs`).
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import importlib.metadata
import inspect
import sys
from typing import Any, Callable, Sequence, Union

from gerl.errors import UserError

Scores = list  # list[float | None], one per image
Extras = dict  # dict[str, list], each list one entry per image
RewardFn = Callable[[list, list, list], Union[Scores, tuple]]

ENTRY_POINT_GROUP = "gerl.rewards"
_FACTORY_MARK = "__gerl_reward_factory__"
_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def reward_factory(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
    """Mark `factory` as a reward factory without registering a name (for `module:callable` and entry points).

    Args:
        factory: a function or class that takes keyword arguments and returns a reward callable.
    """
    setattr(factory, _FACTORY_MARK, True)
    return factory


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a reward factory under `name`.

    Args:
        name: the name configs use (`reward.name: <name>`); must be unique.
    """

    def decorator(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        known = _REGISTRY.get(name)
        # Re-registering the same object happens when a module is imported twice (e.g. as __main__); allow it.
        if known is not None and _qualname(known) != _qualname(factory):
            raise ValueError(f"reward name {name!r} is already registered by {_qualname(known)}")
        _REGISTRY[name] = reward_factory(factory)
        return factory

    return decorator


def registered_names() -> list[str]:
    """Names registered with `@register`, plus those advertised in the `gerl.rewards` entry-point group."""
    return sorted(set(_REGISTRY) | {ep.name for ep in _entry_points()})


def is_reward_factory(obj: Any) -> bool:
    """Tell a factory (call with kwargs to get a reward) from a ready reward callable.

    The rule, in order: anything marked by `@register` / `@reward_factory` is a factory; a class is a factory
    (its instances are the rewards); a function whose signature has an `images` parameter is a reward;
    any other function is a factory. Callable instances (objects with `__call__`) are rewards.
    """
    if getattr(obj, _FACTORY_MARK, False):
        return True
    if inspect.isclass(obj):
        return True
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        try:
            return "images" not in inspect.signature(obj).parameters
        except (TypeError, ValueError):  # builtins without a signature: treat as a reward
            return False
    return False


def build_reward(name: str, kwargs: dict | None = None) -> RewardFn:
    """Build the reward callable that `name` refers to.

    Args:
        name: a registered name (`ocr`), an entry point in the `gerl.rewards` group, or `package.module:attr`
            where `attr` is a factory or a ready reward callable (see `is_reward_factory`).
        kwargs: keyword arguments for the factory; must be empty for a ready reward callable.

    Raises:
        UserError: unknown name, unimportable module, or kwargs the factory does not accept.
    """
    kwargs = dict(kwargs or {})
    if ":" in name:
        target = _import_attr(name)
    elif name in _REGISTRY:
        target = _REGISTRY[name]
    else:
        target = _load_entry_point(name)
    if not is_reward_factory(target):
        if kwargs:
            raise UserError(
                f"reward {name!r} is a ready reward callable and takes no kwargs (got {sorted(kwargs)}); "
                f"remove reward.kwargs or point reward.name at a factory marked with @reward_factory"
            )
        return target
    _check_kwargs(name, target, kwargs)
    try:
        return target(**kwargs)
    except UserError:
        raise
    except Exception as e:  # e.g. a factory refusing a kwarg's value: the user's to fix, not a crash
        raise UserError(f"reward factory {name!r} raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}; "
                        "check reward.kwargs (--debug shows the traceback)") from e


def call_reward(
    fn: RewardFn, images: Sequence, prompts: Sequence[str], metadata: Sequence[dict]
) -> tuple[list[float | None], dict[str, list]]:
    """Call a reward and normalise what it returns to `(scores, extras)`.

    A coroutine function is allowed: its result is awaited with `asyncio.run` (so call this from a worker
    thread or process, not from inside a running event loop).

    Args:
        fn: the reward callable.
        images: N PIL images.
        prompts: N prompt strings.
        metadata: N dicts (per-prompt fields from the dataset).

    Returns:
        scores: N floats or None (not applicable); extras: dict of per-sample lists of length N.

    Raises:
        UserError: the reward returned the wrong shape (its author has to fix it).
    """
    n = len(images)
    if len(prompts) != n or len(metadata) != n:
        raise ValueError(f"call_reward got {n} images, {len(prompts)} prompts and {len(metadata)} metadata dicts")
    out = fn(list(images), list(prompts), list(metadata))
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    extras: dict = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, extras = out
    who = _describe(fn)
    try:
        scores = [None if s is None else float(s) for s in out]
    except (TypeError, ValueError) as e:
        raise UserError(f"reward {who} must return a list of floats or None per image, got {out!r:.200} ({e})")
    if len(scores) != n:
        raise UserError(f"reward {who} returned {len(scores)} scores for {n} images; return one (or None) per image")
    for key, values in extras.items():
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise UserError(f"reward {who} extra {key!r} has {got} entries for {n} images; give one per image")
    return scores, {k: list(v) for k, v in extras.items()}


def validate_reward_inputs(fn: RewardFn, prompts: Sequence[str], metadata: Sequence[dict]) -> None:
    """Call `fn.validate(prompts, metadata)` if the reward defines it (raises UserError for unscorable inputs)."""
    if len(prompts) != len(metadata):
        raise ValueError(f"validate_reward_inputs got {len(prompts)} prompts but {len(metadata)} metadata dicts")
    validate = getattr(fn, "validate", None)
    if callable(validate):
        validate(list(prompts), list(metadata))


# --------------------------------------------------------------------------------------------------------------


async def _await(awaitable):
    return await awaitable


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _describe(fn: Any) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or type(fn).__name__


def _entry_points() -> list:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _import_attr(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"reward {spec!r} is not of the form 'package.module:callable'; fix the reward name")
    # A user's module is imported without caching its bytecode: a refused command (the module raises at import)
    # must leave nothing behind, and Python writes __pycache__/ beside the module before running it.
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(
            f"cannot import module {module_name!r} for reward {spec!r} ({e}); check the name and PYTHONPATH"
        )
    except Exception as e:  # the module itself is broken (SyntaxError, an error at import time): say where
        raise UserError(
            f"importing module {module_name!r} for reward {spec!r} raised {type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}; fix the module (--debug shows the traceback)"
        ) from e
    finally:
        sys.dont_write_bytecode = dont_write
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"module {module_name!r} has no attribute {attr!r}; fix the reward name {spec!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"reward {spec!r} is a {type(obj).__name__}, not a callable; point it at a reward or factory")
    return obj


def _load_entry_point(name: str) -> Any:
    for ep in _entry_points():
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:  # a broken third-party plug-in: say which one
                raise UserError(f"reward entry point {name!r} ({ep.value}) failed to load: {e}")
    names = registered_names()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(
        f"unknown reward {name!r}; {hint}registered rewards: {', '.join(names) or '(none)'} "
        f"(or use 'package.module:callable')"
    )


def _check_kwargs(name: str, factory: Callable, kwargs: dict) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return  # no signature to check against
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise UserError(
            f"reward {name!r} got unknown kwargs {unknown}; valid kwargs: {', '.join(valid) or '(none)'}"
        )
    missing = [n for n in valid if params[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise UserError(f"reward {name!r} needs kwargs {missing}; set them under reward.kwargs")
