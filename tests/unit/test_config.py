from __future__ import annotations

from pathlib import Path

import pytest

from governor.admission.endpoint import EndpointLimits, OpenAITarget
from governor.shell import cli
from governor.shell.config import GovernorConfig
from governor.shell.endpoints import parse_endpoint
from governor.shell.server import is_loopback
from govwire.address import Address, parse_address
from govwire.options import ConfigError
from govwire.vocab import DEFAULT_TENANT
from worker.config import WorkerConfig


def parse_serve(argv: list[str]) -> GovernorConfig:
    captured: dict[str, GovernorConfig] = {}

    def fake_serve(config: GovernorConfig) -> int:
        captured["config"] = config
        return 0

    original = cli._serve
    cli._serve = fake_serve
    try:
        assert cli.main(["serve", *argv]) == 0
    finally:
        cli._serve = original
    return captured["config"]


def test_defaults_match_the_documented_contract() -> None:
    config = parse_serve([])
    assert (config.host, config.port, config.metrics_port) == ("127.0.0.1", 7070, 9464)
    assert config.integrity == "required" and config.max_frame_bytes == 1024 * 1024
    assert config.worker == () and config.worker_args == ()


def test_flags_and_worker_passthrough_after_double_dash() -> None:
    config = parse_serve(
        ["--max-inflight", "4", "--integrity", "off", "--", "--engine", "echo", "--token-delay-ms", "50"]
    )
    assert config.max_inflight == 4 and config.integrity == "off"
    assert config.worker_args == ("--engine", "echo", "--token-delay-ms", "50")


def test_repeatable_worker_flag() -> None:
    config = parse_serve(["--worker", "unix:/tmp/a.sock", "--worker", "127.0.0.1:9000"])
    assert config.worker == ("unix:/tmp/a.sock", "127.0.0.1:9000")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-inflight", "0"], "--max-inflight"),
        (["--worker", "nowhere"], "--worker"),
        (["--retry-hint-min-ms", "50", "--retry-hint-max-ms", "10"], "--retry-hint-min-ms"),
        (["--integrity", "maybe"], "--integrity"),
        (["--max-frame-bytes", str(16 * 1024 * 1024 + 1)], "--max-frame-bytes"),
        (["--auth-token-file", "/nonexistent/token"], "--auth-token-file"),
        (["--max-connections", "0"], "--max-connections"),
        (["--max-buffer-bytes", "100"], "--max-buffer-bytes"),
        (["--worker-ping-interval-s", "10", "--worker-ping-timeout-s", "5"], "--worker-ping-interval-s"),
        (["--worker-auth-token-file", "/dev/null"], "--worker-auth-token-file"),
    ],
)
def test_invalid_configuration_fails_naming_the_setting(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_config_validation_outside_the_cli() -> None:
    with pytest.raises(ConfigError, match="drain"):
        GovernorConfig(drain_timeout_s=-1)
    with pytest.raises(ConfigError, match="listen"):
        WorkerConfig(listen="bogus")
    with pytest.raises(ConfigError, match="--drain-timeout-s"):
        WorkerConfig(drain_timeout_s=-1)
    with pytest.raises(ConfigError, match="--tokenizer-nice"):
        WorkerConfig(tokenizer_nice=20)


def test_a_model_path_is_checked_by_the_config_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        WorkerConfig(model=str(tmp_path / "gtp2"))
    with pytest.raises(ConfigError, match="no config.json"):
        WorkerConfig(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert WorkerConfig(model=str(tmp_path)).model == str(tmp_path)  # the rest is the loader's to judge
    assert WorkerConfig(model="random-tiny").model == "random-tiny"
    assert WorkerConfig(engine="echo", model=str(tmp_path / "absent")).engine == "echo"  # echo loads none


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("unix:/tmp/w.sock", Address(path="/tmp/w.sock")),
        ("127.0.0.1:7071", Address(host="127.0.0.1", port=7071)),
        ("[::1]:7071", Address(host="::1", port=7071)),
    ],
)
def test_addresses_round_trip(text: str, address: Address) -> None:
    assert parse_address(text) == address
    assert str(address) == text


@pytest.mark.parametrize("text", ["unix:", "host", "host:0", "host:99999", ":80", "h:x"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="address"):
        parse_address(text)


def test_an_endpoint_carries_its_soft_caps() -> None:
    address, limits = parse_endpoint("10.0.0.1:7071,concurrency=8,qps=2.5,burst=4,weight=2")
    assert str(address) == "10.0.0.1:7071"
    assert limits == EndpointLimits(concurrency=8, qps=2.5, burst=4.0, weight=2.0)
    assert parse_endpoint("unix:/run/w.sock")[1] == EndpointLimits()
    _, forecast = parse_endpoint("http://127.0.0.1:8000/v1,model=m,step_ms=2.5,batch=1")
    assert (forecast.step_ms, forecast.batch) == (2.5, 1)
    with pytest.raises(ValueError, match="batch"):
        parse_endpoint("h:1,batch=-1")


def test_an_openai_endpoint_takes_a_front_door_name_and_an_ignore_eos_policy() -> None:
    target, _ = parse_endpoint("http://127.0.0.1:8000/v1,model=/models/llama,served_as=llama,ignore_eos=refuse")
    assert isinstance(target, OpenAITarget)
    assert (target.model, target.served_as, target.served_name, target.ignore_eos) == (
        "/models/llama",
        "llama",
        "llama",
        "refuse",
    )
    plain, _ = parse_endpoint("http://127.0.0.1:8000/v1,model=m")
    assert isinstance(plain, OpenAITarget) and plain.served_name == "m" and plain.ignore_eos == "pass"
    assert plain.probe  # probed as it comes up unless told not to
    unprobed, _ = parse_endpoint("http://127.0.0.1:8000/v1,model=m,probe=off")
    assert isinstance(unprobed, OpenAITarget) and not unprobed.probe


@pytest.mark.parametrize(
    "spec",
    [
        "h:1,conc=3",
        "h:1,concurrency",
        "h:1,concurrency=1.5",
        "h:1,qps=-1",
        "h:1,weight=0",
        "nowhere",
        "h:1,served_as=x",  # a worker's name is --served-model
        "http://h:1/v1,model=m,ignore_eos=maybe",
        "http://h:1/v1,model=m,probe=no",
        "http://h:1/v1,model=m,served_as=",
    ],
)
def test_a_bad_endpoint_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(ConfigError, match="--worker"):
        GovernorConfig(worker=(spec,))


def test_spawned_workers_get_one_gpu_each() -> None:
    from governor.shell.spawned import gpu_assignment

    assert gpu_assignment(1, "3") == [None]  # a single worker keeps the environment
    assert gpu_assignment(3, None) == ["0", "1", "2"]
    assert gpu_assignment(3, "4, 6") == ["4", "6", "4"]  # the visible ones, round-robin
    assert gpu_assignment(2, "") == ["", ""]  # none visible stays none visible
    with pytest.raises(ConfigError, match="--workers"):
        GovernorConfig(workers=2, worker=("127.0.0.1:7071",))


def test_an_endpoint_listed_twice_or_a_non_finite_cap_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        GovernorConfig(worker=("h:1,concurrency=2", "h:1"))
    with pytest.raises(ConfigError, match="--max-qps"):
        GovernorConfig(max_qps=float("inf"))


def test_an_empty_token_file_is_refused_and_a_token_never_shows_in_the_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="--auth-token-file.*empty"):
        GovernorConfig(auth_token_file=str(empty))
    token = tmp_path / "token"
    token.write_text("hunter2-but-longer\n")
    config = GovernorConfig(auth_token_file=str(token))
    secret = config.client_secret()
    assert secret is not None and secret.tenant_of("hunter2-but-longer") == DEFAULT_TENANT
    assert secret.tenant_of("hunter2") is None
    assert "hunter2" not in repr(config) + repr(secret)


def test_a_clients_token_file_is_one_secret_and_a_servers_tenant_file_is_refused_saying_so(tmp_path: Path) -> None:
    from govwire.auth import SharedSecret

    servers = tmp_path / "tokens"
    servers.write_text("alpha secret-alpha\nbeta secret-beta\n")
    assert GovernorConfig(auth_token_file=str(servers)).client_secret() is not None  # the governor's own
    for text in ("alpha secret-alpha\nbeta secret-beta\n", "alpha secret-alpha\n"):
        servers.write_text(text)
        with pytest.raises(ValueError, match="TENANT SECRET"):
            SharedSecret.read(str(servers))
    servers.write_text("  secret-alpha \n")
    assert SharedSecret.read(str(servers)).matches("secret-alpha")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("example.org", False)],
)
def test_non_loopback_binds_are_recognised(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
