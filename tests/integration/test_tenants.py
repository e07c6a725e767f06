"""Tenants over real sockets: identity from the secret a connection authenticated with, per-tenant
caps and metrics, and SIGHUP changing tenants and secrets without dropping a connection."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Conn, Governor, Worker

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]
SLOW_ECHO = ("--engine", "echo", "--token-delay-ms", "1000")  # a 2-token request holds its slot ~2 s


def test_a_connection_authenticated_as_one_tenant_cannot_act_as_another(start_governor: Start, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha secret-alpha\nbeta secret-beta\n")
    tokens.chmod(0o600)
    gov = start_governor("--auth-token-file", str(tokens), "--tenant", "alpha,max_inflight=1", worker_args=SLOW_ECHO)
    gov.token = "secret-alpha"
    alpha = Conn(gov.port, token="secret-alpha")
    beta = Conn(gov.port, token="secret-beta")
    alpha.send("1", "ab", max_new_tokens=2, stop_on_eos=False)
    alpha.send("2", "ab", max_new_tokens=2, tenant="beta")  # beta has room, but this is alpha
    (reply,) = alpha.until_final("2")
    assert (reply["status"], reply["code"]) == ("error", "tenant_mismatch")
    alpha.send("3", "ab", max_new_tokens=2, tenant="alpha")
    (reply,) = alpha.until_final("3")
    assert (reply["status"], reply["reason"]) == ("yield", "tenant_inflight")  # its own cap of 1
    beta.send("b", "ab", max_new_tokens=2)
    assert beta.until_final("b")[-1]["status"] == "done"
    assert alpha.until_final("1")[-1]["status"] == "done"
    tenants = {t["name"]: t for t in gov.stats()["tenants"]}
    assert (tenants["alpha"]["executed_total"], tenants["alpha"]["yielded_by_reason"]) == (1, {"tenant_inflight": 1})
    assert (tenants["beta"]["executed_total"], tenants["beta"]["yielded_total"]) == (1, 0)
    assert gov.stats()["rejected_by_reason"]["tenant_mismatch"] == 1
    metrics = gov.metrics()
    assert metrics[("governor_tenant_executed_total", (("tenant", "alpha"),))] == 1
    assert metrics[("governor_tenant_yielded_total", (("reason", "tenant_inflight"), ("tenant", "alpha")))] == 1
    assert metrics[("governor_class_executed_total", (("class", "standard"),))] == 2
    for conn in (alpha, beta):
        conn.close()


def test_sighup_adds_changes_and_removes_tenants_and_secrets_without_dropping_a_connection(
    start_worker: Callable[..., Worker], start_governor: Start, tmp_path: Path
) -> None:
    worker = start_worker(*SLOW_ECHO)
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha secret-alpha\n")
    tokens.chmod(0o600)
    config = tmp_path / "governor.toml"
    head = f'auth_token_file = "{tokens}"\n[[endpoint]]\naddress = "{worker.address}"\n'
    config.write_text(head + '[[tenant]]\nname = "alpha"\nmax_inflight = 1\n')
    gov = start_governor("--config", str(config))
    gov.token = "secret-alpha"
    alpha = gov.conn()
    alpha.send("1", "ab", max_new_tokens=2, stop_on_eos=False)
    alpha.send("2", "ab", max_new_tokens=2, stop_on_eos=False)
    assert alpha.until_final("2")[-1]["reason"] == "tenant_inflight"

    # Change alpha's cap, add gamma with a cap of its own and a new secret naming it.
    tokens.write_text("alpha secret-alpha\ngamma secret-gamma\n")
    config.write_text(
        head + '[[tenant]]\nname = "alpha"\nmax_inflight = 2\n[[tenant]]\nname = "gamma"\nmax_qps = 0.5\n'
    )
    gov.proc.send_signal(signal.SIGHUP)
    gov.wait_until(lambda: {t["name"] for t in gov.stats()["tenants"]} == {"alpha", "gamma", "default"}, what="reload")
    alpha.send("3", "ab", max_new_tokens=2, stop_on_eos=False)  # 2 of alpha's new 2, on the same connection
    gamma = Conn(gov.port, token="secret-gamma")
    gamma.send("g1", "ab", max_new_tokens=1)
    gamma.send("g2", "ab", max_new_tokens=1)
    assert gamma.until_final("g2")[-1]["reason"] == "tenant_qps"
    assert gamma.until_final("g1")[-1]["status"] == "done"
    finals = alpha.finals(2)
    assert {f["status"] for f in finals.values()} == {"done"}

    # Remove alpha and its secret: its open connection serves on, as the default tenant.
    tokens.write_text("gamma secret-gamma\n")
    config.write_text(head + '[[tenant]]\nname = "gamma"\nmax_qps = 0.5\n')
    gov.proc.send_signal(signal.SIGHUP)
    gov.token = "secret-gamma"
    gov.wait_until(lambda: {t["name"] for t in gov.stats()["tenants"]} == {"gamma", "default"}, what="reload 2")
    alpha.send("4", "ab", max_new_tokens=2)
    assert alpha.until_final("4")[-1]["status"] == "done"
    tenants = {t["name"]: t for t in gov.stats()["tenants"]}
    assert tenants["default"]["executed_total"] == 1
    stranger = Conn(gov.port)  # the removed secret no longer opens a connection
    stranger.send_raw(b'{"op": "auth", "token": "secret-alpha"}\n')
    assert (stranger.recv()["code"], alpha.sock.fileno() >= 0) == ("unauthorized", True)
    for conn in (stranger, gamma):
        conn.close()
