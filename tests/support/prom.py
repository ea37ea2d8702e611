"""Start a real Prometheus server for tests (loopback only, temporary storage).

    prom = start_prometheus(["127.0.0.1:19400"], rule_files=[RULES])
    try:
        wait_for(lambda: prom.query('ckptwatch_collisions_total'))
    finally:
        prom.stop()

or `with start_prometheus(...) as prom:`. The scrape job is called "ckptwatch" with Prometheus'
default honor_labels (false), exactly as deploy/prometheus/prometheus.yml does, so queries see
the same labels as in production. Skips the calling test if the prometheus binary is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request

import yaml

from helpers import free_port, wait_for

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class Prometheus:
    """A running Prometheus process: query() it, stop() it (idempotent)."""

    def __init__(self, proc: subprocess.Popen, url: str, workdir: str, log_path: str):
        self.proc = proc
        self.url = url
        self.workdir = workdir
        self.log_path = log_path

    def api(self, endpoint: str, **params) -> dict:
        """GET /api/v1/<endpoint>; returns the "data" member, raises on an API error."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}", timeout=5) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus API error: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; a list of {"metric": {labels}, "value": [t, "v"]}."""
        return self.api("query", query=expr)["result"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_prometheus(targets, rule_files=(), scrape_interval: str = "1s",
                     job_name: str = "ckptwatch", timeout: float = 30.0,
                     scrape_options: dict | None = None) -> Prometheus:
    """Start Prometheus scraping `targets` ("host:port"), evaluating `rule_files`.
    scrape_options go into the scrape job as they are (scheme, tls_config, basic_auth,
    metrics_path...).

    Returns once Prometheus is ready (not once it has scraped: wait for the series you need).
    """
    import pytest

    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("prometheus binary not installed")
    workdir = tempfile.mkdtemp(prefix="cwprom")
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval},
        "rule_files": [os.path.abspath(p) for p in rule_files],
        "scrape_configs": [{"job_name": job_name,
                            "static_configs": [{"targets": list(targets)}],
                            **(scrape_options or {})}],
    }
    config_path = os.path.join(workdir, "prometheus.yml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(workdir, "prometheus.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}",
             f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
             f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    prom = Prometheus(proc, url, workdir, log_path)

    def ready():
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{prom.log()}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for(ready, timeout=timeout, interval=0.1, message="prometheus to become ready")
    except BaseException:
        prom.stop()
        raise
    return prom


def wait_for_query(prom: Prometheus, expr: str, predicate=bool, timeout: float = 30.0):
    """Poll an instant query until predicate(results) holds; return the results."""
    last: list = []

    def check():
        nonlocal last
        last = prom.query(expr)
        return predicate(last)

    try:
        wait_for(check, timeout=timeout, interval=0.25, message=f"query {expr!r}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last result: {last}\nprometheus log:\n{prom.log()}") \
            from None
    return last


__all__ = ["Prometheus", "start_prometheus", "wait_for_query"]
