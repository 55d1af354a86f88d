# The repository root is on sys.path for every test (tests import `tests.tiny_model` and friends).
