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
