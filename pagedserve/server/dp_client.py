"""Several engine cores behind one HTTP server (`pagedserve serve --data-parallel-size N`),
vLLM's internal data-parallel mode: each core is its own process with its own KV cache (on
CUDA, its own GPUs: `engine/devices.py`), supervised by its own `AsyncEngineClient` (a dead
or hung core is restarted alone, its in-flight requests fail as with one core).

Each request goes to one core, chosen by `AffinityPolicy` (`affinity.py`, as the Ray Serve
replicas route): a conversation (`Choice.route`: its messages through the first user message,
or its `prompt_cache_key`) stays on the core whose prefix cache holds its earlier turns
unless that core is much busier than the least loaded; new ones go to the least loaded.
Only cores that serve are candidates: while one is dead or restarting, new requests go to
the others. The server is healthy while at least one core serves. (vLLM cannot restart a
core: a dead one fails its whole server. Here the others keep serving while it restarts, so
/health stays 200 and a load balancer keeps sending; the restart shows in
`pagedserve_engine_restarts_total` and the dead core's `engine` series.)

The cores must agree on what the front end validates against (`CoreInfo`: model, context,
vocabulary, ...); the KV capacity may differ (each core sizes its own cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from pagedserve.config import EngineConfig
from pagedserve.engine.messages import CoreInfo, CoreStats
from pagedserve.engine.output_processor import SampleState
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.affinity import AffinityPolicy
from pagedserve.server.engine_client import AsyncEngineClient, EngineDeadError, SpawnedCore
from pagedserve.server.engine_errors import EngineStartError
from pagedserve.server.supervisor import Deadlines, RestartPolicy
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve")

# CoreInfo fields every core must report alike (the front end checks requests against them)
AGREED = ("model_name", "max_model_len", "vocab_size", "block_size", "max_num_seqs", "eos_token_ids")


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` for engine core `rank` (its GPUs: `EngineConfig.first_gpu`)."""
    return dataclasses.replace(config, data_parallel_rank=rank)


def agreed_info(infos: list[CoreInfo]) -> CoreInfo:
    """The one CoreInfo the front end uses: the cores' common facts, the smallest KV cache and
    the slowest start-up; EngineStartError where they disagree."""
    first = infos[0]
    for rank, info in enumerate(infos[1:], 1):
        differ = [f"{name} {getattr(first, name)!r} vs {getattr(info, name)!r}"
                  for name in AGREED if getattr(first, name) != getattr(info, name)]
        if differ:
            raise EngineStartError(f"engine cores 0 and {rank} disagree ({'; '.join(differ)}): "
                                   "every core must load the same model with the same settings")
    return dataclasses.replace(first, num_blocks=min(i.num_blocks for i in infos),
                               startup_seconds=max(i.startup_seconds for i in infos))


def summed_stats(stats: list[CoreStats | None]) -> CoreStats | None:
    """The cores' stats added up (KV usage: the mean over the cores reporting); None if none has
    reported (for the periodic log line)."""
    known = [s for s in stats if s is not None]
    if not known:
        return None
    total = CoreStats(*(sum(getattr(s, f.name) for s in known) for f in dataclasses.fields(CoreStats)))
    total.kv_usage = total.kv_usage / len(known)
    return total


class DataParallelClient:
    """N `AsyncEngineClient`s (`engines`) behind the interface of one; see the module's doc."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, log_level: str = "INFO",
                 cores: list[SpawnedCore | None] | None = None,
                 restart_policy: RestartPolicy | None = None, deadlines: Deadlines | None = None,
                 policy: AffinityPolicy | None = None) -> None:
        """`cores`: engine-core processes already started, one per rank (else `start` spawns)."""
        n = config.data_parallel_size
        cores = cores or [None] * n
        if len(cores) != n:
            raise ValueError(f"{len(cores)} engine cores given for data_parallel_size {n}")
        self.config, self.tokenizer = config, tokenizer
        self.deadlines = deadlines or Deadlines()
        self.engines = [AsyncEngineClient(rank_config(config, i), tokenizer, log_level, core,
                                          restart_policy, self.deadlines)
                        for i, core in enumerate(cores)]
        self.policy = policy or AffinityPolicy()
        self.info: CoreInfo | None = None
        self.on_failure = None  # (source): a request failed before any core had it (app.py sets it)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    async def start(self, timeout: float = 900.0) -> CoreInfo:
        """Start (or wait for) every core; if one fails, stop them all and raise its error."""
        results = await asyncio.gather(*(e.start(timeout) for e in self.engines), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        try:
            if failed:
                raise failed[0]
            self.info = agreed_info(list(results))
        except BaseException:
            await self.shutdown()
            raise
        return self.info

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines))

    # ---- state, as one client's -------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while at least one core serves."""
        return self.info is not None and any(e.healthy for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        if self.healthy:
            return None
        reasons = [f"engine {i}: {e.dead_reason}" for i, e in enumerate(self.engines) if e.dead_reason]
        return "; ".join(reasons) or None

    @property
    def stats(self) -> CoreStats | None:
        return summed_stats([e.stats for e in self.engines])

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.engines)

    @property
    def restarts_allowed(self) -> bool:
        return all(e.restarts_allowed for e in self.engines)

    @restarts_allowed.setter
    def restarts_allowed(self, value: bool) -> None:
        for e in self.engines:
            e.restarts_allowed = value

    def fail_all(self, error: Exception, source: str) -> None:
        for e in self.engines:
            e.fail_all(error, source)

    # ---- requests ---------------------------------------------------------------------

    def choose(self, route: str | None) -> int:
        """The core for a request of conversation `route` (recorded); EngineDeadError when
        none serves."""
        loads = {str(i): e.num_in_flight for i, e in enumerate(self.engines) if e.healthy}
        if not loads:
            raise EngineDeadError(self.dead_reason or "no engine core is serving")
        # (a conversation whose core is down goes to the least loaded live one, and stays)
        choice = self.policy.choose(route, loads)[0]
        self.policy.routed(route, choice)
        return int(choice)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0, route: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[SampleState]:
        """`AsyncEngineClient.generate` on the core `choose` picks for `route`."""
        engine = self.engines[self.choose(route)]
        async for state in engine.generate(request_id, prompt_ids, params, priority, lora_request=lora_request):
            yield state
