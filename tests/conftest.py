import pytest


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False, help="Rewrite tests/golden/* from current output.")


@pytest.fixture
def update_goldens(request) -> bool:
    return bool(request.config.getoption("--update-goldens"))
