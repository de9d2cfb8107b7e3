"""Engine tests share fixtures from tests/conftest.py and helpers from tests/testkit.py."""
