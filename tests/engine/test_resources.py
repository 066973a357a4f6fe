"""What the Ray hosts ask of the cluster: CPUs counted beside GPUs, a per-node packing check before any host
starts, and a set-up deadline that names the host that did not start and why."""

import time

import pytest

from gerl.engine import resources
from gerl.errors import UserError
from tests.train.helpers import small_config

A1_R2 = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cuda", "engine.rollout_workers=2"]


def test_gpu_hosts_reserve_cpus_for_their_reward():
    assert resources.host_request(small_config("/x", *A1_R2)) == {"CPU": 4.0, "GPU": 1.0}  # auto on a GPU layout
    assert resources.host_request(small_config("/x", *A1_R2, "engine.cpus_per_worker=2",
                                               "engine.gpus_per_worker=0.5")) == {"CPU": 2.0, "GPU": 0.5}
    assert resources.host_request(small_config("/x", "engine.kind=ray", "engine.device=cpu")) == {"CPU": 1.0}
    assert resources.host_names(small_config("/x", *A1_R2)) == ["actor0", "rollout0", "rollout1"]
    assert resources.rehearsal_init_args(small_config("/x", *A1_R2)) == {"num_gpus": 3, "num_cpus": 12}


def test_fit_counts_cpus_and_gpus_and_packs_per_node():
    cfg = small_config("/x", *A1_R2)
    resources.check_fits(cfg, [{"GPU": 3, "CPU": 12}])
    resources.check_fits(cfg, [{"GPU": 2, "CPU": 8}, {"GPU": 1, "CPU": 4}])
    # the reviewer's hang: Ray declaring 3 GPUs on 2 CPUs; the last host would never be scheduled
    with pytest.raises(UserError, match=r"asks for 12 CPUs \(1 actor \+ 2 rollout hosts × 4 engine.cpus_per_worker "
                                        r"\(0 = auto: 4 per GPU host\)\) but the Ray cluster has 2"):
        resources.check_fits(cfg, [{"GPU": 3, "CPU": 2}])
    with pytest.raises(UserError, match=r"asks for 3 GPUs .* but the Ray cluster has 2"):
        resources.check_fits(cfg, [{"GPU": 2, "CPU": 64}])
    # enough in total, but no node holds a whole host: 3 GPUs on a node with 4 CPUs, 8 CPUs on a node without GPU
    with pytest.raises(UserError, match=r"host rollout0 asks for 1 GPU \+ 4 CPUs on one node, and no node has that"):
        resources.check_fits(cfg, [{"GPU": 3, "CPU": 4}, {"CPU": 8}])
    half = small_config("/x", *A1_R2, "engine.gpus_per_worker=0.5", "engine.cpus_per_worker=1",
                        "engine.rollout_workers=1", "data.prompts_per_step=2")
    resources.check_fits(half, [{"GPU": 1, "CPU": 2}])  # 1 actor + 1 rollout at half a GPU each: one GPU


@pytest.mark.usefixtures("ray_cluster")  # tests/engine/conftest.py: 2 CPUs, no GPU
def test_setup_deadline_names_the_host_and_the_cause():
    import ray

    @ray.remote(num_cpus=0)
    class Slow:
        def setup(self):
            time.sleep(30)

    @ray.remote(num_cpus=0, num_gpus=1)  # no GPU in this cluster: Ray can never place it
    class Unplaceable:
        def setup(self):
            return "never"

    slow, lost = Slow.remote(), Unplaceable.remote()
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        resources.wait_for_setup(ray, [slow.setup.remote(), lost.setup.remote()], ["actor0", "rollout0"],
                                 {"CPU": 0.0, "GPU": 1.0}, timeout_s=2)
    assert time.monotonic() - t0 < 20, "the deadline holds"  # well short of the 30 s set-up, with slack for a busy Ray
    msg = str(e.value)
    assert "hosts actor0, rollout0 did not start within engine.setup_timeout_s=2 s" in msg
    assert "Ray could not place it: it asks for 1 GPU + 0 CPUs and the cluster has only 0 GPUs" in msg
    ray.kill(slow)
    ray.kill(lost)
    with pytest.raises(UserError, match=r"host actor0 did not start .* most likely still loading the model"):
        slow = Slow.remote()
        resources.wait_for_setup(ray, [slow.setup.remote()], ["actor0"], {"CPU": 0.0}, timeout_s=1)
    ray.kill(slow)
