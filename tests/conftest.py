"""Keep every test's disk cache out of the user's home cache."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _aotgrad_cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTGRAD_CACHE_DIR", str(tmp_path_factory.mktemp("aotgrad-cache")))
    yield
    mp.undo()
