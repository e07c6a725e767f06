"""`--config PATH`: TOML settings and [[endpoint]] tables under the flags, and the SIGHUP re-read."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.admission.caps import Caps
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.shell.config_file import config_sources, load_config, reload_config, render_config
from governor.shell.endpoints import parse_endpoint
from govwire.options import ConfigError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "governor.toml"
    path.write_text(text)
    return str(path)


POOL = """
max_inflight = 20
max-qps = 50
[[endpoint]]
address = "127.0.0.1:7071"
concurrency = 8
[[endpoint]]
address = "127.0.0.1:7072"
qps = 2.5
weight = 2
"""


def test_the_file_sets_caps_and_endpoints_and_flags_win(tmp_path: Path) -> None:
    path = write(tmp_path, POOL)
    config = load_config({"config": path, "max_inflight": 12})
    assert config.max_inflight == 12 and config.max_qps == 50.0
    assert config.worker == ("127.0.0.1:7071,concurrency=8", "127.0.0.1:7072,qps=2.5,weight=2")
    Path(path).write_text(POOL.replace("max-qps = 50", "max-qps = 70").replace("concurrency = 8", "concurrency = 4"))
    reloaded = reload_config(config)
    assert reloaded.max_inflight == 12 and reloaded.max_qps == 70.0  # the flag still wins; the file moved
    assert reloaded.worker[0] == "127.0.0.1:7071,concurrency=4"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_inflight = 'many'", "max_inflight"),
        ("max_inflight = true", "max_inflight"),
        ("retry_hint = 'sometimes'", "retry_hint"),
        ("maximum_inflight = 3", "unknown setting 'maximum_inflight'"),
        ("[[endpoint]]\nconcurrency = 3", "endpoint 1"),
        ("[[endpoint]]\naddress = 'h:1'\nconcurency = 3", "endpoint 1"),
        ("[[endpoint]]\naddress = 'h:1'\nqps = -1", "--worker"),
        ("max_inflight = [", "--config"),
    ],
)
def test_a_bad_file_is_refused_naming_the_setting(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"config": write(tmp_path, text)})


def test_live_limits_keep_what_the_bucket_holds_and_never_cancel() -> None:
    endpoint = Endpoint("e", EndpointLimits(concurrency=4, qps=10.0), 0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(), 8)
    admission = Admission([endpoint], Caps(max_inflight=8, max_qps=10.0, qps_burst=5.0), hints, 0.0)
    grants = [admission.decide(0.0) for _ in range(3)]
    assert all(isinstance(g, Grant) and g.endpoint is endpoint for g in grants)
    endpoint.set_limits(EndpointLimits(concurrency=2, qps=10.0, burst=20.0), 0.0)
    assert endpoint.inflight == 3  # nothing running was touched
    assert isinstance(admission.decide(0.0), Refusal)  # but nothing new until it falls under 2
    admission.release(grants[0], executed=True)  # type: ignore[arg-type]
    admission.release(grants[1], executed=True)  # type: ignore[arg-type]
    admission.set_caps(Caps(max_inflight=8, max_qps=10.0, qps_burst=1.0), 0.0)
    bucket = admission.rate.bucket
    assert bucket is not None and bucket.tokens == 1.0  # held 2, the new burst is 1
    last = admission.decide(0.0)
    assert isinstance(last, Grant) and last.endpoint is endpoint


def test_precedence_is_flag_then_environment_then_file_then_default(tmp_path: Path) -> None:
    path = write(tmp_path, POOL)
    env = {"GOVERNOR_CONFIG": path, "GOVERNOR_MAX_INFLIGHT": "30", "GOVERNOR_IDLE_TIMEOUT_S": "9.5", "GOVERNOR_X": "?"}
    config = load_config({}, environ=env)
    assert (config.max_inflight, config.max_qps, config.idle_timeout_s, config.port) == (30, 50.0, 9.5, 7070)
    assert load_config({"max_inflight": 12}, environ=env).max_inflight == 12
    assert config_sources({"port": 1}, env) == {
        "max_inflight": "env",
        "idle_timeout_s": "env",
        "config": "env",
        "max_qps": "file",
        "worker": "file",
        "port": "flag",
    }
    Path(path).write_text(POOL.replace("max_inflight = 20", "max_inflight = 99"))
    assert reload_config(config).max_inflight == 30  # what the environment set survives a reload


def test_the_environment_takes_space_separated_endpoints_and_names_a_bad_variable() -> None:
    config = load_config({}, environ={"GOVERNOR_WORKER": "127.0.0.1:1,concurrency=2 127.0.0.1:2"})
    assert config.worker == ("127.0.0.1:1,concurrency=2", "127.0.0.1:2")
    for variable, value in (("GOVERNOR_MAX_QPS", "fast"), ("GOVERNOR_INTEGRITY", "maybe"), ("GOVERNOR_HOST", " ")):
        with pytest.raises(ConfigError, match=f"\\${variable}") as info:
            load_config({}, environ={variable: value})
        assert variable != "GOVERNOR_INTEGRITY" or "'required' or 'optional' or 'off'" in str(info.value)


def test_the_printed_configuration_is_a_config_file_that_loads_to_the_same_settings(tmp_path: Path) -> None:
    flags = {"config": write(tmp_path, POOL), "log_level": "debug"}
    config = load_config(flags, environ={})
    text = render_config(config, config_sources(flags, {}))
    assert 'log_level = "debug"  # flag' in text and "max_qps = 50.0  # file" in text
    again = load_config({"config": write(tmp_path, text)}, environ={})
    fields = ("max_inflight", "max_qps", "log_level", "retry_hint", "idle_timeout_s", "host")
    assert all(getattr(again, name) == getattr(config, name) for name in fields)
    assert [parse_endpoint(w) for w in again.worker] == [parse_endpoint(w) for w in config.worker]
