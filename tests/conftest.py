import warnings

import pytest

from moeshard.parallel import RankPool

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def ranks2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks4():
    with RankPool(4) as pool:
        yield pool


@pytest.fixture
def torch_ops(monkeypatch):
    """moeshard.kernels off (as on a CPU without them): the engine runs torch's ops, here and in the
    ranks it spawns."""
    from moeshard import kernels

    monkeypatch.setenv("MOESHARD_CPU_KERNELS", "0")
    kernels.built.cache_clear()
    yield
    monkeypatch.undo()
    kernels.built.cache_clear()


def pytest_collection_modifyitems(items):
    """The tests marked `long_pole` first. pytest-xdist hands out the multi-test groups, then every
    other test in collection order: a long pole collected late (test_verify_layer's matrix, by name)
    started when the rest was done and ran alone while the other worker idled."""
    items.sort(key=lambda item: item.get_closest_marker("long_pole") is None)
