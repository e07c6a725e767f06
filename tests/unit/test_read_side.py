"""The read side (governor/report/): `stats`, /metrics and `governor status` read one snapshot, so
they agree on every number they share."""

from __future__ import annotations

import dataclasses
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from governor.admission.tenant import TenantLimits
from governor.doors.ndjson import Ingress
from governor.links.upstream import Upstream
from governor.report.metrics import build_registry
from governor.report.snapshot.reading import read
from governor.report.status import render_status
from governor.state import ServerState
from govwire.codec import encode, generate_frame
from tests.fakes import done_frame, make_ingress, make_state, worker_sends


def samples(state: ServerState) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(build_registry(state, Upstream([]))).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def busy_state() -> tuple[ServerState, Ingress]:
    """Two of five frames admitted (r0, done, and r1), three yielded; some of tenant acme's."""
    state = make_state(max_inflight=2, tenants={"acme": TenantLimits(weight=2.0)}, tenant_from_frame=True)
    ingress, _ = make_ingress(state)
    frames = [generate_frame(f"r{i}", "hello", max_new_tokens=4) for i in range(5)]
    for frame in frames[::2]:
        frame["tenant"] = "acme"
    ingress.receive_data(b"".join(encode(frame) for frame in frames))
    worker_sends(state, done_frame(ingress.active["r0"].uid, "hi", prompt_tokens=1, completion_tokens=2))
    return state, ingress


def test_stats_metrics_and_status_show_the_same_numbers() -> None:
    state, _ = busy_state()
    before = make_state(max_inflight=2).snapshot()  # a governor that has seen nothing yet
    stats, scraped = state.snapshot(), samples(state)
    page = render_status(before, stats, 1.0)

    assert (stats["inflight"], stats["executed_total"], stats["yielded_total"]) == (1, 1, 3)
    assert scraped[("governor_inflight", ())] == stats["inflight"]
    assert scraped[("governor_executed_total", ())] == stats["executed_total"]
    yielded = {
        dict(labels)["reason"]: n for (name, labels), n in scraped.items() if name == "governor_yielded_total" and n
    }
    assert yielded == {reason: n for reason, n in stats["yielded_by_reason"].items() if n} == {"inflight": 3}
    governor_line = page.splitlines()[0]
    assert f"{stats['inflight']}/{stats['max_inflight']} in flight" in governor_line
    assert f"executed {stats['executed_total']:.1f}/s, yielded {stats['yielded_total']:.1f}/s" in page
    assert "yields since start: inflight 3\n" in page

    (acme,) = [t for t in stats["tenants"] if t["name"] == "acme"]
    assert scraped[("governor_tenant_admitted_total", (("tenant", "acme"),))] == acme["admitted_total"]
    assert (
        scraped[("governor_tenant_yielded_total", (("reason", "inflight"), ("tenant", "acme")))]
        == (acme["yielded_by_reason"]["inflight"])
    )
    assert scraped[("governor_tenant_service_lead", (("tenant", "acme"),))] == pytest.approx(acme["service_lead"])
    line = re.search(r"  acme \(weight 2\): (\d+) in flight, admitted ([\d.]+)/s", page)
    assert line is not None and (int(line[1]), float(line[2])) == (acme["inflight"], acme["admitted_total"])


def test_a_snapshot_is_read_once_and_does_not_follow_the_governor() -> None:
    state, ingress = busy_state()
    snap = read(state)
    assert snap.to_dict() == state.snapshot()  # the stats reply is the snapshot's wire form
    worker_sends(state, done_frame(ingress.active["r1"].uid, "x", completion_tokens=1))
    assert (snap.inflight, snap.counts.executed) == (1, 1)  # read before the second done
    assert (state.snapshot()["inflight"], state.snapshot()["executed_total"]) == (0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.inflight = 0  # type: ignore[misc]
