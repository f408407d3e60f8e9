"""The worker's persistent block tables (`engine/block_tables.py`, torch-free): a step's diff
(new tables, new blocks, blocks given back, preemption and resumption, ended requests)
applied to host rows that live from step to step, and a step's tables gathered from them.
The scheduler's side of the diff is checked against these rows in test_scheduler.py and
test_kv_sliding_window.py (preemption, drafts given back, sliding windows)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.engine.block_tables import BlockTables, table_rows
from pagedserve.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput


def test_a_diff_over_steps_keeps_each_table_and_rows_outlive_steps():
    t = BlockTables(max_blocks=2, rows=1)  # (grows both ways)
    t.apply(SchedulerOutput(new_requests=[NewRequestData("a", [1], None, [4, 5]), NewRequestData("b", [1], None, [7])],
                            chunks=[ScheduledChunk("a", 0, 8, blocks_from=2), ScheduledChunk("b", 0, 3, blocks_from=1)]))
    assert t.block_ids("a") == [4, 5] and t.block_ids("b") == [7]
    row_a = t.row_of["a"]
    t.apply(SchedulerOutput(chunks=[ScheduledChunk("a", 8, 1, [9], blocks_from=2), ScheduledChunk("b", 3, 1, blocks_from=1)]))
    assert t.block_ids("a") == [4, 5, 9] and t.block_ids("b") == [7] and t.row_of["a"] == row_a
    # rejected drafts gave a's last block back, then a new one came: sent from its new end
    t.apply(SchedulerOutput(chunks=[ScheduledChunk("a", 9, 1, [11], blocks_from=2)]))
    assert t.block_ids("a") == [4, 5, 11]
    assert t.gather(["b", "a"]).tolist() == [[7, 0, 0], [4, 5, 11]]  # (past a row's length: stale)
    # a preempted request loses its table; resumed, it is sent whole (a row of its own again)
    t.apply(SchedulerOutput(preempted=["b"], chunks=[ScheduledChunk("a", 10, 1, blocks_from=3)]))
    assert "b" not in t and len(t) == 1
    with pytest.raises(KeyError, match="request b has no block table"):
        t.apply(SchedulerOutput(chunks=[ScheduledChunk("b", 0, 4, [3], blocks_from=0)]))
    t.apply(SchedulerOutput(chunks=[ScheduledChunk("b", 0, 4, [3, 2, 1, 0, 8], resumed=True)]))
    assert t.block_ids("b") == [3, 2, 1, 0, 8] and t.table.shape[1] >= 5
    # a request whose preemption never reached the worker (a lost step): resumed, overwritten
    t.apply(SchedulerOutput(chunks=[ScheduledChunk("b", 0, 4, [6], resumed=True)]))
    assert t.block_ids("b") == [6] and t.gather(["a", "b"]).tolist() == [[4, 5, 11], [6, 2, 1]]
    t.drop("a")
    t.drop("a")  # (twice: no harm)
    t.apply(SchedulerOutput(new_requests=[NewRequestData("a", [1], None, [1])]))  # an id reused
    assert t.block_ids("a") == [1] and sorted(t.row_of.values()) == [0, 1]


def test_entries_past_those_held_are_refused():
    t = BlockTables(max_blocks=4)
    t.set("a", [1, 2])
    with pytest.raises(ValueError, match="from 3 sent, but only 2 are held"):
        t.update("a", 3, [5])


def test_table_rows_from_lists():
    rows = table_rows([[1, 2, 3], [4]])
    assert rows.dtype == np.int32 and rows.tolist() == [[1, 2, 3], [4, 0, 0]]


def test_blocks_given_back_after_rejected_drafts_are_sent_again_from_the_new_end():
    """Drafts took a second block; all were rejected, so it went back (`trim`): the next
    chunks send the table from its new end, and the worker's rows follow the scheduler's."""
    from pagedserve.config import SchedulerConfig
    from pagedserve.engine.kv_cache_manager import KVCacheManager
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import Scheduler
    from pagedserve.sampling_params import SamplingParams

    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32), kv)
    req = Request("a", [1, 2], SamplingParams(max_tokens=10), max_tokens=10)
    sched.add_request(req)
    worker = BlockTables(max_blocks=8)
    sent = []

    def step(new_tokens, drafts=()):
        req.draft_token_ids = list(drafts)
        out = sched.schedule()
        worker.apply(out)
        (c,) = out.chunks
        sent.append((c.blocks_from, len(c.new_block_ids)))
        assert worker.block_ids("a") == kv.block_ids("a")
        sched.apply_results(out, {"a": new_tokens})

    step([3])  # the prompt: one block, sent with the new request
    step([9], drafts=[4, 5, 6])  # positions 2..5: a second block; every draft rejected
    assert len(kv.block_ids("a")) == 1  # (given back)
    step([10])  # position 3: the table is one block again
    step([11])  # position 4: a second block, sent from index 1
    assert sent == [(1, 0), (1, 1), (1, 0), (1, 1)]
