"""The headers that gateways and their clients already speak, both ways. No I/O.

A request behind the Kubernetes Gateway API Inference Extension (GAIE) and llm-d, NVIDIA Dynamo
or the OpenAI SDKs arrives with headers that say who it is for, how much it matters, how long it
may wait and which attempt it is; the answers those systems act on are headers too. This module
is the one place that names them and says what each means here (docs/operations.md, *Behind a
gateway*, has the tables):

In, read by the front door (`read`), under llm-d's names and the older `x-gateway-*` ones:

- `x-llm-d-inference-fairness-id`: the tenant, only where it is trusted: with `--tenant-from
  header`, or from a peer named by `--trusted-gateway`. Anyone else's is ignored, so a client can
  never choose its tenant by sending it. Empty, it names nobody (llm-d's `default-flow`).
- `x-llm-d-inference-objective` (the `InferenceObjective` the request names, mapped to a class
  by `--objective NAME=CLASS`; a name not in the map is ignored, as llm-d's picker gives an
  unknown objective the default priority 0) and `x-dynamo-request-priority` (an integer, higher
  first; `--priority-critical-from` and `--priority-sheddable-below` cut it into classes, and
  like GAIE's priorities a negative one is sheddable by default): the request's `priority`.
- `x-llm-d-inference-ttl` (a Go duration: `1500ms`, `2s`, `1m30s`) and `x-llm-d-slo-ttft-ms`
  (milliseconds): the request's `deadline_ms`, the tighter of them and of the body's own: refused
  at once when the forecast misses it.
- `x-stainless-retry-count` (the OpenAI and Anthropic SDKs send it on every attempt, 0 on the
  first): above 0 the request is a retry.

A header that is malformed, repeated where it holds one value, or that contradicts the body or
another header (a class other than the body's `priority`, two fairness ids) is a 400 naming it.
llm-d's picker ignores a malformed TTL or SLO (it strips both before the request goes on, so a
governor behind it never sees them); here they come from the client itself, and a deadline it
believes in but that is silently dropped would be a broken promise, so they are refused.

Out, written by the front door: every refusal carries `x-llm-d-request-dropped-reason` in llm-d's
vocabulary (`DROPPED_REASON`; the governor's own reason stays in the body), and an admitted
response `x-llm-d-flow-queue-duration-ms` (how long it was held in the lobby, else 0) and
`x-llm-d-flow-band-headroom-requests` (how many more requests like it the limit that binds first
would admit now).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from governor.doors.gateway_policy import GatewayPolicy
from govwire.errors import BadFrame
from govwire.request import MAX_DEADLINE_MS, is_tenant_name
from govwire.vocab import Priority, YieldReason

FAIRNESS_ID = (b"x-llm-d-inference-fairness-id", b"x-gateway-inference-fairness-id")
OBJECTIVE = (b"x-llm-d-inference-objective", b"x-gateway-inference-objective")
DYNAMO_PRIORITY = b"x-dynamo-request-priority"
TTL = b"x-llm-d-inference-ttl"
SLO_TTFT = (b"x-llm-d-slo-ttft-ms", b"x-slo-ttft-ms")
RETRY_COUNT = b"x-stainless-retry-count"

HEADERS_IN = frozenset({*FAIRNESS_ID, *OBJECTIVE, DYNAMO_PRIORITY, TTL, *SLO_TTFT, RETRY_COUNT})
"""Every request header this module reads (the new name of each, then its older alias)."""

DROPPED = b"x-llm-d-request-dropped-reason"
QUEUE_DURATION = b"x-llm-d-flow-queue-duration-ms"
HEADROOM = b"x-llm-d-flow-band-headroom-requests"

SATURATED = b"rejected-saturated"
TTL_EXPIRED = b"rejected-ttl-expired"
EVICTED = b"evicted"
SHUTTING_DOWN = b"rejected-shutting-down"
NO_ENDPOINTS = b"rejected-no-endpoints"  # with a 503 when no endpoint is up (worker_unavailable)
DROPPED_REASON: dict[str, bytes] = {reason.value: SATURATED for reason in YieldReason}
"""llm-d's word for each yield reason: capacity is `rejected-saturated` (what its flow control
answers a full band with), a deadline the forecast misses is `rejected-ttl-expired` (the TTL would
expire before service), a displaced request `evicted`, a drain `rejected-shutting-down`."""
DROPPED_REASON |= {
    YieldReason.DEADLINE.value: TTL_EXPIRED,
    YieldReason.PREEMPTED.value: EVICTED,
    YieldReason.DRAINING.value: SHUTTING_DOWN,
}

_MAX_VALUE_BYTES = 64  # a number, a duration, a name: nothing longer is one
_GO_DURATION = re.compile(r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "μs": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_NUMBER = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?")
_INTEGER = re.compile(r"-?[0-9]{1,10}")  # ASCII digits only (int() takes others, and `_`)
_I32 = 2**31


@dataclass(slots=True)
class GatewayAsk:
    """What one request's gateway headers say (None: they say nothing of it)."""

    tenant: str | None = None
    priority: Priority | None = None
    deadline_ms: float | None = None
    retry_count: int = 0


def _one(headers: dict[bytes, bytes], names: bytes | tuple[bytes, ...]) -> tuple[bytes, str] | None:
    """A header that holds one value, under its name or its alias: None when absent; a 400 when
    repeated, given twice with different values, or oversized (the door joins a repeated header's
    values with commas, as RFC 9110 does for lists)."""
    found: tuple[bytes, str] | None = None
    for name in (names,) if isinstance(names, bytes) else names:
        value = headers.get(name)
        if value is None:
            continue
        if len(value) > _MAX_VALUE_BYTES:
            raise BadFrame(f"{name.decode()}: longer than {_MAX_VALUE_BYTES} bytes")
        if b"," in value:
            raise BadFrame(f"{name.decode()}: one value expected, got several")
        text = value.strip().decode("utf-8", "replace")
        if found is not None and found[1] != text:
            raise BadFrame(f"{found[0].decode()} and {name.decode()} disagree ({found[1]!r}, {text!r})")
        found = (name, text)
    return found


def _integer(headers: dict[bytes, bytes], name: bytes) -> int | None:
    found = _one(headers, name)
    if found is None:
        return None
    text = found[1]
    if _INTEGER.fullmatch(text) is None:
        raise BadFrame(f"{name.decode()}: {text[:32]!r} is not an integer")
    value = int(text)
    if not -_I32 <= value < _I32:
        raise BadFrame(f"{name.decode()}: {value} is outside a 32-bit integer")
    return value


def _deadline(found: tuple[bytes, str] | None, go_duration: bool) -> float | None:
    """A deadline header's milliseconds: a Go duration (`go_duration`) or a number of ms; a 400
    unless positive and at most a day (`MAX_DEADLINE_MS`)."""
    if found is None:
        return None
    name, text = found
    if go_duration:
        if _GO_DURATION.fullmatch(text) is None:
            raise BadFrame(f"{name.decode()}: {text[:32]!r} is not a duration (e.g. 1500ms, 2s, 1m30s)")
        ms = sum(float(n) * _UNIT_MS[unit] for n, unit in _DURATION_PART.findall(text))
    else:
        if _NUMBER.fullmatch(text) is None:
            raise BadFrame(f"{name.decode()}: {text[:32]!r} is not a number of milliseconds")
        ms = float(text)
    if not 0 < ms <= MAX_DEADLINE_MS:
        raise BadFrame(f"{name.decode()}: {text[:32]!r} must be in (0, {MAX_DEADLINE_MS}] ms")
    return ms


def read(headers: dict[bytes, bytes], policy: GatewayPolicy, trusted: bool) -> GatewayAsk:
    """The gateway headers of one request (only those in `HEADERS_IN` are in `headers`). Raises
    `BadFrame` naming the header at fault."""
    ask = GatewayAsk()
    if trusted:
        fairness = _one(headers, FAIRNESS_ID)
        if fairness is not None and fairness[1]:
            name, tenant = fairness
            if not is_tenant_name(tenant):
                raise BadFrame(f"{name.decode()}: {tenant[:32]!r} is not a tenant name ([A-Za-z0-9_.-], 1-64)")
            ask.tenant = tenant
    classes: dict[bytes, Priority] = {}
    objective = _one(headers, OBJECTIVE)
    if objective is not None and objective[1] in policy.objectives:
        classes[objective[0]] = policy.objectives[objective[1]]
    value = _integer(headers, DYNAMO_PRIORITY)
    if value is not None:
        classes[DYNAMO_PRIORITY] = policy.class_of(value)
    if len(set(classes.values())) > 1:
        named = ", ".join(f"{name.decode()} ({klass.value})" for name, klass in classes.items())
        raise BadFrame(f"the priority headers contradict each other: {named}")
    if classes:
        ask.priority = next(iter(classes.values()))
    deadlines = [d for d in (_deadline(_one(headers, TTL), True), _deadline(_one(headers, SLO_TTFT), False)) if d]
    if deadlines:
        ask.deadline_ms = min(deadlines)
    count = _integer(headers, RETRY_COUNT)
    if count is not None:
        if count < 0:
            raise BadFrame(f"{RETRY_COUNT.decode()}: {count} is negative")
        ask.retry_count = count
    return ask


def apply(ask: GatewayAsk, body: dict[str, object]) -> None:
    """Put the class and deadline the headers give into the request body, where every later step
    reads them: a class that contradicts the body's `priority` is a 400 naming the header; a
    deadline the body sets too is the tighter of the two."""
    if ask.priority is not None:
        own = body.get("priority")
        if own is not None and own != ask.priority.value:
            said = f"the priority headers say {ask.priority.value}"
            raise BadFrame(f"{said}, the body's priority {str(own)[:32]!r}: the request contradicts itself")
        body["priority"] = ask.priority.value
    if ask.deadline_ms is not None:
        own = body.get("deadline_ms")
        if own is None or (type(own) in (int, float) and own > ask.deadline_ms):  # type: ignore[operator]
            body["deadline_ms"] = ask.deadline_ms  # (an invalid one stays: the frame's check refuses it)
