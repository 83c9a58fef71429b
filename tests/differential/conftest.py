def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the differential cases make test runs (selection.is_fast)")
