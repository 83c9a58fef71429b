import pytest

from aotgrad.store import disk


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Each test gets its own empty on-disk cache."""
    d = tmp_path / "aotgrad-cache"
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(d))
    monkeypatch.delenv("AOTGRAD_CACHE", raising=False)
    disk._warned.clear()
    return d
