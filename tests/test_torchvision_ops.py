"""gerl/torchvision_ops.py: torchvision's op schemas declared (no kernels) when its compiled ops cannot load.

The real case (PyPI's CUDA torchvision 0.28.0 beside the CPU torch) runs in tests/rewards/test_packaged_run.py and
scripts/vllm_check.sh, where that torchvision is installed; gerl's own venv keeps torchvision out, so here the
pieces run on their own: the loader's verdict on a library that cannot load, and the declared schemas.
"""

from __future__ import annotations

import subprocess
import sys

from gerl import torchvision_ops


def test_ops_load_reports_why_a_library_does_not_load(tmp_path):
    assert "no _C" in torchvision_ops.ops_load(tmp_path)
    (tmp_path / "_C.so").write_bytes(b"not an ELF file")
    assert "_C.so" in torchvision_ops.ops_load(tmp_path) or "ELF" in torchvision_ops.ops_load(tmp_path)


def test_declared_schemas_are_torchvisions_and_have_no_kernels():
    code = (
        "from gerl import torchvision_ops as t; t.declare_schemas(); t.declare_schemas(); import torch\n"
        "print(torch.ops.torchvision.nms.default._schema)\n"
        "print(sum(hasattr(torch.ops.torchvision, s.split('(')[0]) for s in t.SCHEMAS))\n"
        "try:\n    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
        "except NotImplementedError as e:\n    print('no kernel')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    schema, count, kernel = run.stdout.strip().splitlines()[-3:]
    assert schema == "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    assert int(count) == len(torchvision_ops.SCHEMAS)  # every op _meta_registrations names resolves
    assert kernel == "no kernel"  # calling a compiled op still fails: nothing pretends to implement it


def test_install_is_idempotent_and_steps_aside_without_torchvision():
    code = (
        "import sys; from gerl import torchvision_ops as t; t.install(); t.install()\n"
        "print(sum(isinstance(f, t._Hook) for f in sys.meta_path))\n"
        "try:\n    import torchvision\nexcept ImportError:\n    pass\n"
        "print(sum(isinstance(f, t._Hook) for f in sys.meta_path), t.declared)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = run.stdout.strip().splitlines()[-2:]
    assert before == "1"  # armed once
    # the hook removed itself on the first `import torchvision`; declared only if a torchvision was found and failed
    assert after.split()[0] == "0"
