"""The gateway headers, read and checked (doors/gateway.py), and how far they are trusted (gateway_policy.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.doors import gateway
from governor.doors.gateway import GatewayAsk, apply, read
from governor.doors.gateway_policy import GatewayPolicy, parse_objective, parse_trusted
from govwire.errors import BadFrame
from govwire.vocab import Priority, YieldReason

POLICY = GatewayPolicy(objectives={"chat": Priority.CRITICAL, "batch": Priority.SHEDDABLE})


def headers(**values: str) -> dict[bytes, bytes]:
    """Header names as keyword arguments, `_` for `-`."""
    return {name.replace("_", "-").encode(): value.encode() for name, value in values.items()}


def refused(named: str, trusted: bool = True, **values: str) -> str:
    with pytest.raises(BadFrame) as caught:
        read(headers(**values), POLICY, trusted)
    assert named in caught.value.message
    return caught.value.message


def test_a_trusted_fairness_id_names_the_tenant_and_an_untrusted_one_is_ignored() -> None:
    assert read(headers(x_llm_d_inference_fairness_id="team-a"), POLICY, True).tenant == "team-a"
    assert read(headers(x_gateway_inference_fairness_id="team-a"), POLICY, True).tenant == "team-a"  # the old name
    assert read(headers(x_llm_d_inference_fairness_id="team-a"), POLICY, False).tenant is None
    assert read(headers(x_llm_d_inference_fairness_id=""), POLICY, True).tenant is None  # llm-d's default-flow
    refused("x-llm-d-inference-fairness-id", x_llm_d_inference_fairness_id="a b")
    refused("x-llm-d-inference-fairness-id", x_llm_d_inference_fairness_id="a, b")  # repeated: joined by the door
    refused("disagree", x_llm_d_inference_fairness_id="a", x_gateway_inference_fairness_id="b")
    refused("longer than", x_llm_d_inference_fairness_id="a" * 65)
    # the same name under both headers is one tenant
    both = headers(x_llm_d_inference_fairness_id="a", x_gateway_inference_fairness_id="a")
    assert read(both, POLICY, True).tenant == "a"


def test_objectives_and_integer_priorities_map_onto_the_classes() -> None:
    assert read(headers(x_llm_d_inference_objective="chat"), POLICY, False).priority is Priority.CRITICAL
    assert read(headers(x_gateway_inference_objective="batch"), POLICY, False).priority is Priority.SHEDDABLE
    assert read(headers(x_llm_d_inference_objective="unknown"), POLICY, False).priority is None  # as llm-d: ignored
    for value, klass in (("5", Priority.CRITICAL), ("1", Priority.CRITICAL), ("0", Priority.STANDARD)):
        assert read(headers(x_dynamo_request_priority=value), POLICY, False).priority is klass
    assert read(headers(x_dynamo_request_priority="-1"), POLICY, False).priority is Priority.SHEDDABLE
    shifted = GatewayPolicy(critical_from=10, sheddable_below=-5)
    assert read(headers(x_dynamo_request_priority="5"), shifted, False).priority is Priority.STANDARD
    assert read(headers(x_dynamo_request_priority="-6"), shifted, False).priority is Priority.SHEDDABLE
    refused("x-dynamo-request-priority", x_dynamo_request_priority="high")
    refused("32-bit", x_dynamo_request_priority=str(2**31))
    refused("contradict", x_llm_d_inference_objective="chat", x_dynamo_request_priority="-3")
    agreeing = headers(x_llm_d_inference_objective="chat", x_dynamo_request_priority="3")
    assert read(agreeing, POLICY, False).priority is Priority.CRITICAL


def test_a_ttl_is_a_go_duration_and_an_slo_milliseconds_and_the_tighter_is_the_deadline() -> None:
    for text, ms in (("1500ms", 1500), ("2s", 2000), ("1m30s", 90_000), ("1h", 3_600_000), ("0.5s", 500)):
        assert read(headers(x_llm_d_inference_ttl=text), POLICY, False).deadline_ms == pytest.approx(ms)
    assert read(headers(x_llm_d_slo_ttft_ms="250"), POLICY, False).deadline_ms == 250
    assert read(headers(x_slo_ttft_ms="2.5"), POLICY, False).deadline_ms == 2.5
    both = headers(x_llm_d_inference_ttl="2s", x_llm_d_slo_ttft_ms="300")
    assert read(both, POLICY, False).deadline_ms == 300
    for bad in ("-1s", "0s", "soon", "1500", "", "25h", "\u0663s"):
        refused("x-llm-d-inference-ttl", x_llm_d_inference_ttl=bad)
    for bad in ("-1", "0", "250ms", "1e3"):
        refused("x-llm-d-slo-ttft-ms", x_llm_d_slo_ttft_ms=bad)


def test_the_sdk_retry_count_marks_a_retry() -> None:
    assert read(headers(x_stainless_retry_count="0"), POLICY, False).retry_count == 0
    assert read(headers(x_stainless_retry_count="2"), POLICY, False).retry_count == 2
    refused("x-stainless-retry-count", x_stainless_retry_count="-1")
    refused("x-stainless-retry-count", x_stainless_retry_count="two")
    refused("x-stainless-retry-count", x_stainless_retry_count="1_000")  # int() would take it
    refused("x-stainless-retry-count", x_stainless_retry_count="\u0663")  # an Arabic-Indic 3: ASCII digits only


def test_the_headers_go_into_the_body_and_a_contradiction_is_refused() -> None:
    body: dict[str, object] = {"deadline_ms": 5000}
    apply(GatewayAsk(priority=Priority.CRITICAL, deadline_ms=300), body)
    assert body == {"priority": "critical", "deadline_ms": 300}
    tighter: dict[str, object] = {"deadline_ms": 100, "priority": "critical"}
    apply(GatewayAsk(priority=Priority.CRITICAL, deadline_ms=300), tighter)
    assert tighter == {"deadline_ms": 100, "priority": "critical"}  # the body's own was tighter
    invalid: dict[str, object] = {"deadline_ms": -1}
    apply(GatewayAsk(deadline_ms=300), invalid)
    assert invalid == {"deadline_ms": -1}  # left for the frame's check to refuse
    with pytest.raises(BadFrame, match="priority"):
        apply(GatewayAsk(priority=Priority.SHEDDABLE), {"priority": "critical"})


@given(
    st.dictionaries(
        st.sampled_from(sorted(gateway.HEADERS_IN)),
        st.binary(max_size=80),
        max_size=len(gateway.HEADERS_IN),
    ),
    st.booleans(),
)
def test_any_header_values_are_read_or_refused_with_a_bad_frame(values: dict[bytes, bytes], trusted: bool) -> None:
    try:
        said = read(values, POLICY, trusted)
    except BadFrame as exc:
        assert any(name.decode() in exc.message for name in values) or "priority headers" in exc.message
        return
    assert said.deadline_ms is None or 0 < said.deadline_ms <= 86_400_000
    assert said.retry_count >= 0
    assert said.tenant is None or trusted


def test_every_yield_reason_has_a_dropped_reason_in_llm_ds_words() -> None:
    assert set(gateway.DROPPED_REASON) == {reason.value for reason in YieldReason}
    assert gateway.DROPPED_REASON["inflight"] == b"rejected-saturated"
    assert gateway.DROPPED_REASON["deadline"] == b"rejected-ttl-expired"
    assert gateway.DROPPED_REASON["preempted"] == b"evicted"
    assert gateway.DROPPED_REASON["draining"] == b"rejected-shutting-down"


def test_trust_is_by_peer_address_or_for_everyone_under_tenant_from_header() -> None:
    policy = GatewayPolicy(trusted=(parse_trusted("10.0.0.0/8"), parse_trusted("::1")))
    assert policy.trusts(("10.1.2.3", 40000))
    assert policy.trusts(("::ffff:10.1.2.3", 40000, 0, 0))  # a dual-stack listener's IPv4 peer
    assert policy.trusts(("::1", 40000, 0, 0))
    assert not policy.trusts(("127.0.0.1", 40000))
    assert not policy.trusts("/run/governor.sock") and not policy.trusts(None)
    assert GatewayPolicy(tenant_from_header=True).trusts(None)
    assert not GatewayPolicy().trusts(("10.1.2.3", 40000))
    with pytest.raises(ValueError, match="CIDR"):
        parse_trusted("10.0.0.0/33")
    assert parse_objective("chat = critical") == ("chat", Priority.CRITICAL)
    with pytest.raises(ValueError, match="NAME="):
        parse_objective("chat=urgent")
    with pytest.raises(ValueError, match="sheddable-below"):
        GatewayPolicy(critical_from=0, sheddable_below=1)
