"""A local Ray cluster of 2 CPUs for the modules that ask for it (`pytestmark = usefixtures("ray_cluster")`); the
lifecycle tests start and stop their own Ray, so this is not autouse.

Every module-wide Ray here keeps the hosts a run leaves for the module's next run (gerl/engine/pool.py):
a host's start-up is ~7 s of CPU (a Ray worker importing torch, diffusers and transformers), most of a short run's.
tests/engine/test_pool.py shows a kept host trains exactly as a fresh one."""

import pytest

from gerl.engine import pool
from gerl.engine.resources import own_ray_env


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    own_ray_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with pool.kept():
        yield
    ray.shutdown()
