"""The namespace-cluster tests take one host-wide lock each: they create and count network namespaces, which
are host-wide, so two of them on different pytest-xdist workers would see each other's namespaces (the
teardown checks compare the host's namespaces before and after)."""
import fcntl
import os
import tempfile

import pytest


@pytest.fixture(autouse=True)
def _one_cluster_test_at_a_time(request):
    if not request.node.module.__name__.endswith(("test_cluster_smoke", "test_cluster_wire")):
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "lightning_topk_netns_tests.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
