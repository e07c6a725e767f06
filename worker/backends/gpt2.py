"""The GPT-2 backend of the worker's socket server: `LLMEngine` driven by one thread.

The event loop only moves frames; model steps run on a dedicated thread (torch releases the GIL
inside its kernels), so a long prefill never stalls reading cancellations or writing tokens.
Requests and cancellations reach it through an inbox read at step boundaries; each step's events
come back to the loop in one `call_soon_threadsafe`.

**Every torch call happens on that one thread**: setting the thread count, loading the model and
every step. torch's CPU kernels run on OpenMP, and libgomp gives each thread that starts parallel
work its own team of worker threads. Two such threads (formerly the loader on an executor thread
and the stepping thread) mean more OpenMP-managed threads than cores, and then libgomp cuts its
spin-wait to a few iterations (`do_spin` switches to `gomp_throttled_spin_count_var` when
`gomp_managed_threads > gomp_available_cpus`): every barrier between two parallel regions puts
the workers to sleep on a futex and wakes them again. On 2 cores that was ~2,500 voluntary context
switches per batch-32 decode step and steps twice as slow as in-process (docs/benchmarks/sittings.md).
Prompts are tokenized on a thread of their own (`gpt2-tokenizer`, with its own tokenizer
instance: a fast tokenizer must not be used from two threads at once), in arrival order, so a
huge prompt does not stop the running requests' tokens while it is tokenized (transformers' fast
tokenizers release the GIL while they encode). On a CPU-bound worker that thread would still take
a core from the step's OpenMP team, whose barriers then wait for the preempted thread, so it runs
at a lower priority (`--tokenizer-nice`): running streams get the cores first, new prompts the
rest (docs/benchmarks/sittings.md has the inter-token latencies). Detokenizing, one token at a time, stays
with the engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import signal
import threading
from dataclasses import dataclass

import torch

from govwire.errors import GovernorError, InternalError, RequestRejected
from govwire.messages import Completion, EngineStats
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason
from worker import int8
from worker.allocator import keep_freed_memory
from worker.backends.base import RequestSink
from worker.config import WorkerConfig
from worker.engine import FinishEvent, LLMEngine, TokenEvent
from worker.loading import load, resolve_device, resolve_dtype
from worker.scheduler import SchedulerConfig
from worker.sequence import Sequence
from worker.tokenizer import Tokenizer

PREFILL_TOKENS = 2048
"""The prompt tokens of a step under `--max-prefill-tokens 0` (the default), on every device: all
of them while nothing decodes. Beside decoding streams the CPU takes fewer: a prompt token costs
~0.6 ms there (GPT-2 small, 2 threads), and 2,048 of them stalled running streams ~0.55 s per
896-token prompt (docs/benchmarks/sittings.md 5), so its engine learns a budget that keeps a step
within 1.8 decode-only steps, never below 64 (prefill_budget.py; 64 where steps overlap). On a
GPU a 2,048-token chunk takes a few milliseconds."""

log = logging.getLogger("worker.gpt2")


class _Handle:
    __slots__ = ("_backend", "cancelled")

    def __init__(self, backend: GPT2Backend) -> None:
        self._backend = backend
        self.cancelled = False  # read by both threads: a request cancelled before it reaches the engine

    def cancel(self) -> None:
        self.cancelled = True
        self._backend._post(_Cancel(self))


@dataclass(frozen=True, slots=True)
class _Submit:
    handle: _Handle
    request: GenerateRequest
    sink: RequestSink


@dataclass(frozen=True, slots=True)
class _Tokenized:
    """A submitted request on its way from the tokenizer thread to the engine thread."""

    submit: _Submit
    prompt_ids: list[int] | None  # None: cancelled before it was tokenized
    error: Exception | None = None  # the tokenizer failed on it


@dataclass(frozen=True, slots=True)
class _Cancel:
    handle: _Handle


# A request cancelled while it waited for the tokenizer: it never reached the engine.
_CANCELLED_UNSTARTED = Completion(
    text="", prompt_tokens=0, completion_tokens=0, finish_reason=FinishReason.CANCELLED, queue_wait_ms=0.0
)


# What the engine thread hands to the loop: (sink, event or error), in order.
_Delivery = list[tuple[RequestSink, TokenEvent | FinishEvent | Completion | GovernorError]]


class GPT2Backend:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._inbox: list[_Tokenized | _Cancel] = []
        self._to_tokenize: queue.SimpleQueue[_Submit | None] = queue.SimpleQueue()  # None: stop
        self._tokenizer_thread: threading.Thread | None = None
        self._stopping = False
        self._threads = 0
        self._stats = EngineStats()  # replaced whole by the engine thread (_publish_stats)
        # Owned by the engine thread:
        self._by_handle: dict[_Handle, Sequence] = {}
        self._sinks: dict[Sequence, tuple[_Handle, RequestSink]] = {}

    async def start(self) -> None:
        """Start the engine thread and wait until it has loaded the model (or failed to)."""
        loop = self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="gpt2-engine", daemon=True)
        self._thread.start()
        await ready
        engine = self._engine
        assert engine is not None  # set by the thread before `ready` resolves
        self._tokenizer_thread = threading.Thread(
            target=self._tokenize, args=(engine.tokenizer.clone(),), name="gpt2-tokenizer", daemon=True
        )
        self._tokenizer_thread.start()
        config = self.config
        log.info(
            "event=engine_ready model=%s device=%s dtype=%s quantize=%s int8_kernel=%s cpu_capability=%s layers=%d"
            " kv_cache_tokens=%d kv_cache_dtype=%s kv_cache_mib=%.1f threads=%d",
            config.model,
            engine.runner.device,
            str(engine.runner.dtype).removeprefix("torch."),
            config.quantize,
            int8.isa() if config.quantize == "int8" else "-",
            torch.backends.cpu.get_cpu_capability(),
            engine.runner.model.shape.n_layer,
            config.kv_cache_tokens,
            str(engine.runner.cache.keys.dtype).removeprefix("torch."),
            engine.runner.cache.nbytes / 2**20,
            self._threads,
        )

    def _build(self) -> LLMEngine:
        """On the engine thread: everything that touches torch, so it all runs in one OpenMP team."""
        config = self.config
        if not keep_freed_memory():
            log.info("event=allocator_default reason=%s", "no glibc mallopt")
        if config.threads:
            torch.set_num_threads(config.threads)
        self._threads = torch.get_num_threads()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, config.quantize)
        loaded = load(config.model, device, dtype, config.quantize, config.kv_cache_dtype)
        scheduling = SchedulerConfig(
            max_batch_size=config.max_batch_size,
            prefill_max_batch_size=config.prefill_max_batch_size or config.max_batch_size,
            max_prefill_tokens=config.max_prefill_tokens or PREFILL_TOKENS,
            kv_cache_tokens=config.kv_cache_tokens,
            max_running=config.max_running,
            kv_block_size=config.kv_block_size,
            prefix_caching=config.prefix_caching,
            kv_reservation=config.kv_reservation,
        )
        overlap = {"auto": None, "on": True, "off": False}[config.async_scheduling]
        engine = LLMEngine.for_model(
            loaded,
            scheduling,
            cuda_graphs=config.cuda_graphs,
            overlap=overlap,
            # A budget set by hand is kept as it is, beside streams too.
            learned_prefill=device.type == "cpu" and not config.max_prefill_tokens,
        )
        # What is alive now (the model, the tokenizer, torch and transformers) lives as long as the
        # worker: out of the collector's sight, a full collection no longer walks it, and its
        # pauses (which land in inter-token latency) stay short, as vLLM does.
        gc.collect()
        gc.freeze()
        return engine

    def submit(self, request: GenerateRequest, sink: RequestSink) -> _Handle:
        handle = _Handle(self)
        self._to_tokenize.put(_Submit(handle, request, sink))
        return handle

    def _post(self, item: _Tokenized | _Cancel) -> None:
        with self._wakeup:
            self._inbox.append(item)
            self._wakeup.notify()

    def stats(self) -> EngineStats:
        """The engine's state as of its last step: published by the engine thread, so its parts
        agree (used + cached + free blocks = capacity)."""
        return self._stats

    def _publish_stats(self, engine: LLMEngine) -> None:
        """On the engine thread, between steps: a consistent snapshot for `stats`."""
        c = engine.counters
        s = engine.scheduler
        blocks = s.blocks
        self._stats = EngineStats(
            steps_total=c.steps,
            step_sequences_total=c.step_sequences,
            prefill_tokens_total=c.prefill_tokens,
            generated_tokens_total=c.generated_tokens,
            finished_total=c.finished,
            busy_seconds_total=round(c.busy_seconds, 6),
            running=len(s.running),
            waiting=len(s.waiting),
            kv_cache_used_tokens=blocks.num_used * blocks.block_size,
            kv_cache_capacity_tokens=blocks.num_blocks * blocks.block_size,
            kv_cache_bytes=engine.runner.cache.nbytes,
            kv_cache_usage_ratio=round(blocks.num_used / blocks.num_blocks, 6),
            kv_cache_capacity_blocks=blocks.num_blocks,
            kv_cache_used_blocks=blocks.num_used,
            kv_cache_cached_blocks=blocks.num_cached,
            kv_cache_free_blocks=blocks.num_free,
            prefix_cache_queries_tokens_total=blocks.counters.queries,
            prefix_cache_hits_tokens_total=blocks.counters.hits,
            preemptions_total=s.num_preemptions,
            max_batch_size=s.config.max_batch_size,
            max_running=s.config.running_cap,
            max_prefill_tokens=s.config.max_prefill_tokens,
            step_seconds=round(c.busy_seconds / c.steps, 6) if c.steps else None,
        )

    async def close(self) -> None:
        """Stop: what is queued for the tokenizer reaches the engine first, which then ends every
        request it holds with `cancelled`."""
        if self._tokenizer_thread is not None:
            self._to_tokenize.put(None)
            await asyncio.to_thread(self._tokenizer_thread.join)
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- tokenizer thread --------------------------------------------------------------------------

    def _tokenize(self, tokenizer: Tokenizer) -> None:
        if self.config.tokenizer_nice:
            try:  # on Linux a thread id names the thread alone
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.tokenizer_nice)
            except OSError as exc:
                log.warning("event=tokenizer_nice_failed nice=%d error=%r", self.config.tokenizer_nice, str(exc))
        while (item := self._to_tokenize.get()) is not None:
            if item.handle.cancelled:
                self._post(_Tokenized(item, None))
                continue
            try:
                request = item.request
                text = request.prompt if request.messages is None else tokenizer.render_chat(request.messages)
                self._post(_Tokenized(item, tokenizer.encode(text)))
            except Exception as exc:  # that request fails, nothing else
                log.exception("event=tokenize_failed")
                self._post(_Tokenized(item, None, exc))

    # -- engine thread -----------------------------------------------------------------------------

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None  # start() sets it before starting this thread
        try:
            engine = self._engine = self._build()
        except BaseException as exc:  # e.g. ModelLoadError: start() raises it in the loop
            loop.call_soon_threadsafe(_settle, ready, exc)
            return
        self._publish_stats(engine)
        loop.call_soon_threadsafe(_settle, ready, None)
        while True:
            with self._wakeup:
                while not self._inbox and not engine.has_work and not self._stopping:
                    self._wakeup.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            out: _Delivery = []
            try:
                self._take(engine, inbox, out)
                if stopping:
                    for event in engine.drain():
                        self._emit(event, out)
                    for seq in list(self._sinks):
                        finished = engine.cancel(seq)
                        if finished is not None:
                            self._emit(finished, out)
                elif engine.has_work:
                    for event in engine.step():
                        self._emit(event, out)
            except Exception as exc:  # a failed step fails the requests it holds, not the thread
                log.exception("event=engine_step_failed")
                self._fail_everything(engine, exc, out)
                if engine.runner.device.type == "cuda":
                    # CUDA errors are sticky: every later step would fail too. Exit; the
                    # governor restarts the worker.
                    log.critical("event=engine_fatal device=cuda action=exit")
                    os.kill(os.getpid(), signal.SIGTERM)
            self._publish_stats(engine)
            self._deliver(out)
            if stopping:
                return

    def _fail_everything(self, engine: LLMEngine, exc: Exception, out: _Delivery) -> None:
        """Every request still owned gets its one final reply: an `internal` error."""
        engine.fail_all()
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        for _, sink in self._sinks.values():
            out.append((sink, InternalError(error)))
        self._sinks.clear()
        self._by_handle.clear()

    def _take(self, engine: LLMEngine, inbox: list[_Tokenized | _Cancel], out: _Delivery) -> None:
        for item in inbox:
            if isinstance(item, _Tokenized):
                self._start(engine, item, out)
                continue
            seq = self._by_handle.get(item.handle)
            if seq is not None:  # else still with the tokenizer: its flag is set, _start sees it
                finished = engine.cancel(seq)
                if finished is not None:
                    self._emit(finished, out)

    def _start(self, engine: LLMEngine, item: _Tokenized, out: _Delivery) -> None:
        submit = item.submit
        if item.error is not None:
            error = item.error
            out.append((submit.sink, InternalError(f"cannot tokenize the prompt: {type(error).__name__}: {error}")))
            return
        if item.prompt_ids is None:
            out.append((submit.sink, _CANCELLED_UNSTARTED))
            return
        try:
            seq = engine.add_tokenized(submit.request, item.prompt_ids)
        except RequestRejected as exc:
            out.append((submit.sink, exc))
            return
        except Exception as exc:  # that request fails; the rest of the inbox is still taken
            log.exception("event=request_start_failed")
            out.append((submit.sink, InternalError(f"cannot start the request: {type(exc).__name__}: {exc}")))
            return
        self._by_handle[submit.handle] = seq
        self._sinks[seq] = (submit.handle, submit.sink)
        if submit.handle.cancelled:  # cancelled while it was being tokenized
            finished = engine.cancel(seq)
            if finished is not None:
                self._emit(finished, out)

    def _emit(self, event: TokenEvent | FinishEvent, out: _Delivery) -> None:
        if isinstance(event, TokenEvent):
            out.append((self._sinks[event.seq][1], event))
            return
        handle, sink = self._sinks.pop(event.seq)
        del self._by_handle[handle]
        out.append((sink, event))

    def _deliver(self, out: _Delivery) -> None:
        if out and self._loop is not None:
            self._loop.call_soon_threadsafe(_dispatch, out)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # start() was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _dispatch(out: _Delivery) -> None:
    for sink, event in out:
        if isinstance(event, TokenEvent):
            sink.token(event.index, event.token_id, event.text)
        elif isinstance(event, FinishEvent):
            if event.tail:  # held text no token completed: the stream still adds up to the text
                sink.token(len(event.seq.output_ids), None, event.tail)
            sink.done(event.completion)
        elif isinstance(event, Completion):
            sink.done(event)
        else:
            sink.error(event)
