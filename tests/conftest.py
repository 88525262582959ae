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
