"""A local Ray cluster of 2 CPUs for the modules that ask for it (`pytestmark = usefixtures("ray_cluster")`); the
lifecycle tests start and stop their own Ray, so this is not autouse."""

import pytest

from gerl.engine.resources import own_ray_env


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    own_ray_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
