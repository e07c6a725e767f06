"""What both doors (the NDJSON port and the HTTP front door) do the same way once admission has
answered: the step from a grant to a dispatched request, and how one read's replies leave.

Each door keeps its own call of `Admission.decide` and renders its own refusal (the yield path is
decided and encoded inline, in the read that brought the frame); what follows a grant is here.
"""

from __future__ import annotations

from collections.abc import Callable

from governor.accounting import outcome_of
from governor.admission.limits import Grant
from governor.lifecycle import InflightRequest, Lifecycle, RequestOwner
from govwire.errors import RequestRejected, WorkerUnavailable
from govwire.request import GenerateRequest


def admit_and_dispatch(
    lifecycle: Lifecycle,
    owner: RequestOwner,
    request_id: str,
    grant: Grant,
    now: float,
    check: Callable[[], GenerateRequest],
) -> tuple[InflightRequest, GenerateRequest] | RequestRejected | WorkerUnavailable:
    """Register a granted frame, check it (`check` builds its generate request: every field, its
    integrity) and dispatch it. A frame that fails its checks, or that no endpoint can take, is
    refused (what admission charged comes back, its slot is freed) and the error returned for
    the door to render; only the envelope and the cost were read before the grant, so refusing
    stays cheap whatever the frame holds."""
    request = lifecycle.admit(owner, request_id, grant, now)
    try:
        generate = check()
        lifecycle.dispatch(request, generate)
    except (RequestRejected, WorkerUnavailable) as exc:
        lifecycle.refuse(request, outcome_of(exc), exc.code)
        return exc
    return request, generate


def flush_pending(pending: list[bytes], write: Callable[[bytes], None]) -> None:
    """Write what a read (or a link's callback) produced, in one write, and forget it."""
    if pending:
        data = b"".join(pending)
        pending.clear()
        if data:
            write(data)
