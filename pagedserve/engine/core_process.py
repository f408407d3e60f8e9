"""The engine core in its own process, talking to the front end over ZeroMQ.

The front end (HTTP server) binds two IPC sockets; the core process connects to both:

    front end  --PUSH-->  [requests]  --PULL-->  core   AddRequest / AbortRequests / Shutdown
    front end  <--PULL--  [outputs]   <--PUSH--  core   Ready / StartFailed / StepOutputs / Rejected

The messages (`engine/messages.py`) are pickled dataclasses: both ends are pagedserve
processes of one user. This module imports no torch until the process builds its engine.
The core steps whenever it has unfinished requests and waits on its input otherwise (at most
BEAT_INTERVAL_S at a time: each turn of its loop stamps its `Heartbeat`, which the server's
supervisor reads to tell a hung core from a busy one).
A request or a step that fails comes back as outputs with finish_reason "error"
(`EngineCore.step`) and the core serves on; MAX_CONSECUTIVE_FAILURES failed steps in a row
(a broken device, say) end the process with exit code 1, and the front end starts a new one.
The process also ends within a second of its parent's death (`lifeline.die_with_parent`).
"""

from __future__ import annotations

import gc
import logging
import os
import traceback

from pagedserve.config import EngineConfig
from pagedserve.engine.heartbeat import BEAT_INTERVAL_S, Heartbeat
from pagedserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreInfo,
    CoreStats,
    Ready,
    Rejected,
    Shutdown,
    StartFailed,
    StepOutputs,
)
from pagedserve.heap import HeapTrimmer
from pagedserve.lifeline import die_with_parent

logger = logging.getLogger("pagedserve")
MAX_CONSECUTIVE_FAILURES = 3
START_FAILED_LINGER_MS = 60_000  # how long a core that failed to start waits to say why
# After work, an idle core waits this long for more before it returns freed memory to the OS
# (n = 64 samples with 7 MB of stop strings left 1.5 GB held after they ended).
IDLE_TRIM_S = 0.5


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, log_level: str = "INFO",
                    parent_pid: int | None = None, parent_death_signal: bool = True,
                    heartbeat: Heartbeat | None = None) -> None:
    """Entry point of the engine-core process; it ends when `parent_pid` does. `heartbeat`:
    stamped by the loop once the core is ready (a new one if not given)."""
    if parent_pid is not None:
        die_with_parent(parent_pid, use_signal=parent_death_signal)
    import zmq

    name = f"engine-core {config.data_parallel_rank}" if config.data_parallel_size > 1 else "engine-core"
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    try:
        from pagedserve.engine.core import EngineCore, FatalEngineError
        from pagedserve.engine.devices import claim_devices

        claim_devices(config)  # (several engine cores: this one's GPUs)
        core = EngineCore(config)
    except Exception as e:
        reason = str(e) if isinstance(e, ValueError) else None  # the settings are at fault
        out.send_pyobj(StartFailed(traceback.format_exc(), reason))
        # The server may bind its socket only after loading its tokenizer (the core starts
        # first): wait long enough for the message to reach it, or it never learns why.
        inp.close(linger=0)
        out.close(linger=START_FAILED_LINGER_MS)
        ctx.term()  # returns once the message is delivered (or the wait is over)
        return
    # Start-up leaves a great many long-lived objects (the model, compiled kernels, graphs).
    # Frozen, they are out of the garbage collector's view, so a full collection while serving
    # scans only what came later (one took 147 ms inside a concurrency-256 step on the H200).
    gc.collect()
    gc.freeze()
    sched = core.scheduler_config
    out.send_pyobj(Ready(CoreInfo(
        core.source.name, sched.max_model_len, core.model_config.vocab_size, core.kv.num_blocks,
        core.kv.block_size, sched.max_num_seqs, core.model_config.eos_token_ids,
        core.startup_seconds,
    )))
    try:
        heartbeat = heartbeat or Heartbeat()
        core.executor.on_progress(heartbeat.beat)
        _loop(core, inp, out, heartbeat)
    except FatalEngineError as e:
        logger.error("%s", e)
        core.executor.close()  # (worker processes, if any, end now rather than with this one)
        out.close(linger=2000)  # the failed requests' outputs go out first
        # No interpreter clean-up: with a broken device it could hang instead of exiting.
        os._exit(1)
    core.executor.close()
    out.close(linger=1000)
    inp.close(linger=0)


def _loop(core, inp, out, heartbeat: Heartbeat | None = None,
          heap: HeapTrimmer | None = None) -> None:
    heartbeat = heartbeat or Heartbeat()
    heap = heap or HeapTrimmer(min_interval_s=IDLE_TRIM_S)
    while True:
        heartbeat.beat()
        # Wait (a beat's interval at most) while idle, IDLE_TRIM_S after work: then the memory
        # it freed goes back to the OS (`heap.py`); otherwise only drain what has arrived.
        timeout = 0 if core.has_unfinished_requests() else int(1000 * min(BEAT_INTERVAL_S, (
            max(IDLE_TRIM_S, heap.wait_s()) if heap.pending else BEAT_INTERVAL_S)))
        changed = False
        while inp.poll(timeout):
            heartbeat.beat()
            msg = inp.recv_pyobj()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequest):
                for request in msg.requests:
                    try:
                        core.add_request(request)
                    except ValueError as e:
                        out.send_pyobj(Rejected(request.request_id, str(e)))
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
            else:
                logger.error("ignoring an unknown message: %r", type(msg))
            changed, timeout, heap.pending = True, 0, True
        if core.has_unfinished_requests():
            heartbeat.step_started()
            outputs = core.step()  # (failed requests are in outputs, with their errors)
            heartbeat.step_ended()
            out.send_pyobj(StepOutputs(outputs, core_stats(core)))
            if core.fatal_error or core.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILURES:
                from pagedserve.engine.core import FatalEngineError

                raise FatalEngineError(core.fatal_error or (
                    f"{core.consecutive_failed_steps} engine steps failed in a row; ending the "
                    "engine core so that a new one starts"))
        elif changed:  # e.g. an abort emptied the engine: report the new state
            out.send_pyobj(StepOutputs([], core_stats(core)))
        elif heap.pending:  # idle for IDLE_TRIM_S: nothing arrived
            heap.trim()


def core_stats(core) -> CoreStats:
    kv, sched, spec = core.kv, core.scheduler, core.speculator
    stats = CoreStats(
        len(sched.running), len(sched.waiting), kv.usage, kv.stats.queries, kv.stats.hits,
        sched.num_preemptions, core.num_prefill_tokens, core.num_generation_tokens,
        core.num_failed_steps, core.num_failed_requests,
        *((spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else ()),
    )
    if kv.tiers is not None:
        t, m = kv.tiers.stats, kv.tiers.moves
        stats.kv_host_hits, stats.kv_disk_hits, stats.kv_tier_misses = t.host_hits, t.disk_hits, t.misses
        stats.kv_offloads, stats.kv_host_bytes, stats.kv_host_seconds = t.offloads, m.host_bytes, m.host_seconds
        stats.kv_disk_bytes, stats.kv_disk_seconds = m.disk_bytes, m.disk_seconds
    return stats
