"""The governor's own code per yielded frame and per admitted request, in-process: no sockets.

The state is built as `governor serve` builds it (`server.build_state`, default flags) over one
real worker link whose transport only collects what it is given. A yielded frame: 64 pipelined
generate frames fed to the NDJSON door while the only slot is held, each answered with a yield.
The same with a service time known, so that refusals book appointments: 3,200 ids sent in turn
(the same clients coming back), or a new id per frame (each a new booking, 0.1 ms service time).
A connection refused again and again answers its frames in the event loop's later turns, not
inside its read (doors/turns.py): the turn queue's slices are run here after each read, as the loop
would, so every frame is answered. An admitted request: one generate frame in (parsed, decided,
checked with its sha256, dispatched through the link), then four token frames and a `done` read by
the link (the byte path, then the lifecycle's `finish`, the door's rendering). What sockets, the
event loop and the worker cost is left out, so the difference between two versions of the code
shows here before noise hides it.

    python -m benchmarks.cost.inprocess_cost [--rounds 7]
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m benchmarks.cost.inprocess_cost --only admitted --iterations N   (N and 0: the difference)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.harness.common import machine, markdown_table
from benchmarks.harness.results import Sitting
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.ttft import TtftModel
from governor.doors.ndjson import Ingress
from governor.doors.turns import FRAMES_PER_TURN
from governor.links.upstream import Upstream
from governor.links.worker_link import WorkerLink
from governor.shell.config import GovernorConfig
from governor.shell.server import build_state
from governor.state import ServerState
from govwire.address import Address
from govwire.codec import encode, encode_done, encode_token, generate_frame
from govwire.messages import Completion
from govwire.vocab import FinishReason

FRAMES_PER_READ = 64
DONE = Completion("abcd", 2, 4, FinishReason.LENGTH, 0.0)


class Collect:
    """A transport (or a client's write) that keeps nothing."""

    def write(self, data: bytes) -> None:
        pass

    def __call__(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return None


def wired(max_inflight: int) -> tuple[ServerState, Ingress, WorkerLink]:
    config = GovernorConfig(max_inflight=max_inflight)
    now = time.monotonic()
    endpoint = Endpoint("w", EndpointLimits(), now, TtftModel(config.deadline_margin))
    upstream = Upstream([(Address(path="/unused"), endpoint)])
    state = build_state(config, upstream, now)
    link = upstream.worker_links[0]
    link.connection_made(Collect())  # type: ignore[arg-type]
    link.data_received(b'{"id":"~ping","status":"pong"}\n')  # up: it answered a ping
    return state, Ingress(state, Collect(), config.max_frame_bytes), link


def yielded(reads: int, service_s: float | None = None, distinct: int = FRAMES_PER_READ) -> float:
    """Seconds per yielded frame. By default nothing is known of how long a request takes (the
    base hint, no appointment). With `service_s` observed the refusals book appointments
    (admission/appointments/): `distinct` ids sent in turn, so with fewer ids than frames the
    same clients keep coming back (as `yield_throughput`'s flood does), and with as many, each
    frame is a new client that books its own."""
    state, ingress, _ = wired(1)
    if service_s is not None:
        state.admission.hints.observe_service_time(service_s)
    ingress.receive_data(encode(generate_frame("holder", "x")))
    frames = [encode(generate_frame(f"r{i}", "hi")) for i in range(distinct)]
    datas = [
        b"".join(frames[(k * FRAMES_PER_READ + i) % distinct] for i in range(FRAMES_PER_READ))
        for k in range(min(reads, -(-distinct // FRAMES_PER_READ)))
    ]
    started = time.perf_counter()
    for k in range(reads):
        ingress.receive_data(datas[k % len(datas)])
        while ingress.held_frames:  # what the loop's turn queue does in its next turns (doors/turns.py)
            ingress.resume(FRAMES_PER_TURN)
    elapsed = time.perf_counter() - started
    refused = state.accounting.yielded_total
    assert refused == reads * FRAMES_PER_READ, f"{refused} of {reads * FRAMES_PER_READ} frames answered with a yield"
    return elapsed / max(1, reads * FRAMES_PER_READ)


def admitted(requests: int) -> float:
    """Seconds per admitted request, from its frame to its `done` (the worker's replies prepared)."""
    state, ingress, link = wired(64)
    frames = [encode(generate_frame(f"r{i}", "hello")) for i in range(requests)]
    replies = []
    for i in range(requests):
        uid = format(i + 1, "x")  # the ids the upstream assigns, in order
        tokens = b"".join(encode_token(uid, n, 97 + n, "abcd"[n]) for n in range(4))
        replies.append(tokens + encode_done(uid, DONE))
    started = time.perf_counter()
    for frame, reply in zip(frames, replies, strict=True):
        ingress.receive_data(frame)
        link.data_received(reply)
    elapsed = time.perf_counter() - started
    assert state.accounting.executed == requests, state.accounting.executed
    return elapsed / max(1, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("yielded", "admitted"), help="one path, once (for callgrind)")
    parser.add_argument("--iterations", type=int, help="with --only: reads of 64 frames, or requests")
    args = parser.parse_args()
    if args.only is not None:
        n = 200 if args.iterations is None else args.iterations
        (yielded if args.only == "yielded" else admitted)(n)
        return
    # created after `--only`, which measures nothing of its own (callgrind counts it) and writes no result
    sitting = Sitting(measures=("govwire", "governor"))
    ys = [yielded(2000) * 1e6 for _ in range(args.rounds)]
    returning = [yielded(500, 0.005, 3200) * 1e6 for _ in range(args.rounds)]
    booking = [yielded(60, 0.0001, 60 * FRAMES_PER_READ) * 1e6 for _ in range(args.rounds)]
    ads = [admitted(20_000) * 1e6 for _ in range(args.rounds)]
    print(f"machine: {machine()}; {args.rounds} rounds\n")
    units = {  # the table's rows: µs per round, whether the summary reports it, decimals shown
        "yielded frame (64 per read)": (ys, True, 2),
        "yielded frame, 3,200 ids in turn, 5 ms service": (returning, False, 2),
        "yielded frame, each a new client booking": (booking, False, 2),
        "admitted request (4 tokens, done)": (ads, True, 1),
    }
    rows = [[unit, f"{min(us):.{d}f}", f"{statistics.median(us):.{d}f}"] for unit, (us, _, d) in units.items()]
    print(markdown_table(["per unit", "best (µs)", "median (µs)"], rows))
    for unit, (us, headline, _) in units.items():
        note = f"median of {len(us)} rounds; best {min(us):.2f} µs"
        sitting.figure(f"in-process, per {unit}", statistics.median(us), "µs", headline=headline, note=note)
    sitting.details = {"rounds_us": {unit: us for unit, (us, _, _) in units.items()}}
    sitting.write()


if __name__ == "__main__":
    main()
