"""The end-to-end tier: real processes -- agents, torchrun jobs, Prometheus, Chromium, helm,
wheel builds. tests/conftest.py marks every test here `e2e` and runs them one at a time."""
