"""Count the memory a program allocates without allocating it: fake tensors plus a storage-counting dispatch mode.

Modules are built on the meta device, then their parameters and buffers are swapped by hand for CPU fake tensors of
the same shape and dtype (`module.to()` cannot swap fake parameters, and fake CUDA tensors abort on a CPU-only torch
build). Under `FakeTensorMode` every op computes shapes only, yet dispatches like a CPU op: SDPA reaches the CPU
flash-attention kernel, which saves for backward the same tensors (output, logsumexp) as CUDA's flash attention.

`StorageCounter` sees every op's outputs and follows each new storage by weak reference: its bytes count from the
op that creates it until the storage dies (autograd's saved tensors keep theirs alive, so they are counted for as
long as the graph holds them). Views and in-place results share a storage already seen and add nothing; storages
that existed before counting began (weights, buffers, inputs) are known on first sight and never counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; torch.cuda.max_memory_allocated counts
# those blocks, so the count rounds each storage up the same way.
BLOCK = 512


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fakeify(module: torch.nn.Module, mode) -> torch.nn.Module:
    """Replace every parameter and buffer of `module` (built on meta) by a CPU fake tensor of the same shape, dtype
    and requires_grad, in place. A tensor shared between submodules (T5's tied embedding) stays shared. Tensors a
    submodule holds as plain attributes are replaced too (Qwen-Image's RoPE tables: complex, kept out of the buffers
    so that a dtype cast leaves them complex)."""
    swapped: dict[int, torch.Tensor] = {}
    with mode:
        for m in module.modules():
            for table, make in ((m._parameters, _fake_param), (m._buffers, _fake_buffer)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in swapped:
                        swapped[id(t)] = make(t)
                    table[name] = swapped[id(t)]
            for name, t in list(vars(m).items()):
                if isinstance(t, torch.Tensor):
                    if id(t) not in swapped:
                        swapped[id(t)] = _fake_buffer(t)
                    setattr(m, name, swapped[id(t)])
    return module


def _fake_param(p: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)


def _fake_buffer(b: torch.Tensor) -> torch.Tensor:
    return torch.empty(b.shape, dtype=b.dtype, device="cpu")


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (a tensor listed twice counts once); works on meta and fake tensors."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


class StorageCounter(TorchDispatchMode):
    """Live and peak bytes of the storages created while the mode is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}  # id(storage) → weak reference whose callback forgets it

    def _forget(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def _track(self, t: torch.Tensor, new: bool) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._seen:
            return
        n = -(-st.nbytes() // BLOCK) * BLOCK if new else 0
        self._seen[key] = weakref.ref(st, lambda _, k=key, n=n: self._forget(k, n))
        self.live += n
        self.peak = max(self.peak, self.live)

    def _each_tensor(self, tree, new: bool) -> None:
        # Op arguments are flat tuples, lists of tensors (cat, foreach ops) or dicts: no general tree walk needed.
        for x in tree:
            if isinstance(x, torch.Tensor):
                self._track(x, new)
            elif isinstance(x, (list, tuple)):
                self._each_tensor(x, new)
            elif isinstance(x, dict):
                self._each_tensor(x.values(), new)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._each_tensor(args, new=False)  # storages allocated before counting: known, never counted
        self._each_tensor(kwargs.values(), new=False)
        out = func(*args, **kwargs)
        self._each_tensor(out if isinstance(out, (list, tuple)) else (out,), new=True)
        return out


def peak_bytes(program, mode) -> int:
    """Peak bytes that `program()` allocates on top of what was live when it started, run under fake `mode`.
    Everything it creates is dropped when it returns."""
    counter = StorageCounter()
    with mode, counter:
        program()
    return counter.peak
