"""The fast tier (`-m "not e2e"`): tests in this process or in short child Pythons, no agent
process, torchrun job, Prometheus, browser, helm or wheel build. A package, like tests/e2e, so
that a test file may have the same name in both tiers (tests/conftest.py)."""
