"""A real Prometheus on a loopback port, its data in a temporary directory, for checking deploy/'s
alert rules, dashboard and adapter queries against a live governor (tests/integration/test_deploy_live.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.harness.fixtures.redis_server import free_port
from tests.deploy_tools import tool
from tests.polling import wait_until


class PrometheusError(AssertionError):
    """The HTTP API answered with an error (a query that does not parse or evaluate)."""


class PrometheusServer:
    """`prometheus` with `config` (a prometheus.yml as a dict), listening on 127.0.0.1 only."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.log = workdir / "prometheus.log"
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0, trust_env=False)

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        argv = [
            tool("prometheus"),
            f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.wait_until(self._ready, timeout, "prometheus to be ready")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()}")
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params: str) -> Any:
        """`data` of /api/v1/`path`; a PrometheusError carrying Prometheus' reason otherwise."""
        body = self.client.get(f"/api/v1/{path}", params=params).json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (a scalar comes back as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        wait_until(check, timeout, what, self.log, interval=0.2)  # each check is an HTTP query
