"""Let torchvision's pure-Python parts import when its compiled ops cannot load (a CUDA wheel beside a CPU torch).

PyPI's only torchvision for torch 2.13 (0.28.0) is a CUDA build: its `_C.so` links libtorch_cuda.so, which the CPU
torch lacks, so `torchvision.extension` fails to load it and reports "no ops" — but `torchvision/__init__.py` then
imports `_meta_registrations`, which registers fake kernels for `torchvision::nms` and friends unconditionally and
stops the whole import with `RuntimeError: operator torchvision::nms does not exist`. transformers' torchvision-backed
image processors (which vLLM's LLaVA imports), hpsv2 and ImageReward use only the pure-Python transforms.

`install()` puts a hook on `sys.meta_path`: when `torchvision` is first imported, it tries to load torchvision's own
`_C.so`; only if that fails does it *declare* the op schemas (no kernels). The import then succeeds, the transforms
work, and calling a compiled op (nms, roi_align, deform_conv2d...) still fails with torchvision's own "Couldn't load
custom C++ ops" error, since `torchvision.extension._has_ops()` stays False. Nothing changes where `_C.so` loads.

Used by the test environments of gerl's optional dependencies on CPU machines (scripts/vllm_check.sh writes a
`.pth` file that calls `install()` into its vLLM venv; tests/rewards/test_packaged_run.py for hpsv2 / ImageReward).
Where a matching torchvision is installed (any GPU machine), none of this is needed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

# torchvision 0.28's schemas (from its _C.so): every op that _meta_registrations / _autograd_registrations name.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
    "-> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_library = None  # the torch.library.Library holding the declared schemas (kept alive: dropping it undefines them)
declared = False  # whether install()'s hook had to declare them


def ops_load(package_dir: Path) -> str | None:
    """None when torchvision's `_C.so` in `package_dir` loads into this torch, else why it does not."""
    import torch

    candidates = sorted(package_dir.glob("_C*.so"))
    if not candidates:
        return f"no _C*.so in {package_dir}"
    try:
        torch.ops.load_library(str(candidates[0]))
        return None
    except OSError as e:
        return str(e.__cause__ or e)


def declare_schemas() -> None:
    """Declare the `torchvision::` op schemas (no kernels), once per process."""
    global _library, declared
    if _library is not None:
        return
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)
    declared = True


class _Hook(importlib.abc.MetaPathFinder):
    """Runs once, on the first `import torchvision`, then steps aside for the normal import."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.submodule_search_locations:
            if ops_load(Path(list(spec.submodule_search_locations)[0])) is not None:
                declare_schemas()
        return None  # the regular finders import it


def install() -> None:
    """Arm the hook (idempotent). If torchvision is already imported, there is nothing left to do."""
    if "torchvision" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
