"""One input path for every step: a host packer and persistent device step buffers.

`pack_step` flattens any step (decodes, prefill chunks, or both) into numpy arrays
(`StepArrays`). `StepBuffers` holds the device copies at fixed addresses, so a CUDA graph
captured over them replays any step that fits its key, and eager steps read the same
buffers: per step one copy of the token rows, one of the per-sequence int32 fields, one of
the block tables. Padding up to a graph's token bucket has slot -1 (no K/V written),
position 0, id 0; padded sequences have seq len 0 (attention writes zeros there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    GraphKey,
)
from pagedserve.host_copy import ALIGN


@dataclass
class StepArrays:
    """The flattened batch of one step on the host (numpy): T tokens of S sequences."""

    ids: np.ndarray  # [T] int64; 0 where the token is still pending on the device
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64 KV-cache slot of each token
    src_rows: np.ndarray  # [T] int64: row of a pending token in the previous step's samples, else -1
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray  # [S] int64, context length including this step's tokens
    tables: np.ndarray  # [S, widest table] int32 block tables
    # [R] int64: the tokens whose logits are needed: each sampling sequence's last token,
    # preceded by the positions of its draft tokens' inputs (R = N + all drafts)
    logits_idx: np.ndarray
    sample_rows: list[int]  # the N sequences that sample, in order
    max_query_len: int
    num_drafts: list[int] | None = None  # [N] draft tokens of each sampling sequence (None: none)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def has_pending(self) -> bool:
        return bool((self.src_rows >= 0).any())


def pack_step(chunks, token_ids: list[list[int]], prev_rows: dict[str, int],
              block_size: int, tables: np.ndarray) -> StepArrays:
    """Flatten a step's chunks (`ScheduledChunk`s; token_ids[i]: the known tokens of chunk
    i's request; tables[i]: its block table, [S, widest] int32, e.g. the worker's persistent
    rows `BlockTables.gather`) into arrays, vectorised except for one loop over sequences. A chunk whose
    last input token is still pending (sampled by the previous step, not yet read back) gets
    id 0 and the row of its request in the previous step's samples. A chunk's draft tokens
    follow its known ones, and each of their positions' logits is needed too."""
    bs = block_size
    n = len(chunks)
    q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=n)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    ids = np.zeros(total, dtype=np.int64)
    src = np.full(total, -1, dtype=np.int64)
    any_drafts = False
    for i, (chunk, toks) in enumerate(zip(chunks, token_ids)):
        s = int(cu[i])
        drafts = chunk.draft_token_ids
        new = chunk.num_tokens - len(drafts)
        known = toks[chunk.start : chunk.start + new]
        ids[s : s + len(known)] = known
        if len(known) < new:  # the last input token is still on the device
            src[s + new - 1] = prev_rows[chunk.request_id]
        if drafts:
            ids[s + new : s + chunk.num_tokens] = drafts
            any_drafts = True
    positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(total)
    row_of_token = np.repeat(np.arange(n), q_lens)
    slots = tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    sample_rows = [i for i, c in enumerate(chunks) if c.samples]
    logits_idx = cu[1:][sample_rows] - 1
    num_drafts = None
    if any_drafts:
        num_drafts = [len(chunks[i].draft_token_ids) for i in sample_rows]
        counts = np.asarray(num_drafts, dtype=np.int64) + 1
        # each sequence's last count tokens: end - count + 0 .. end - count + (count - 1)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_idx = np.repeat(logits_idx + 1 - counts, counts) + offsets
    return StepArrays(ids, positions, slots, src, cu, starts + q_lens, tables,
                      logits_idx, sample_rows, int(q_lens.max()), num_drafts)


def pending_output_rows(request_ids: list[str], outputs: list[list[int]], num_outputs: list[int],
                        prev_rows: dict[str, int]) -> list[int] | None:
    """For penalties under async scheduling: each row's index in the previous step's samples
    where its last output token is still pending there (outputs[i], the host's list, lacks
    it; num_outputs[i]: how many were computed), else -1; None when no row's is pending."""
    rows = []
    for rid, known, n in zip(request_ids, outputs, num_outputs):
        missing = n - len(known)
        if missing == 0:
            rows.append(-1)
        elif missing == 1 and rid in prev_rows:
            rows.append(prev_rows[rid])
        else:
            raise RuntimeError(f"request {rid}: {len(known)} output tokens known on the host "
                               f"where {n} were computed: more than the previous step's are missing")
    return rows if any(i >= 0 for i in rows) else None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SeqLayout:
    """Offsets of the per-sequence int32 fields inside one flat buffer (one copy per step):
    the common ones, then the attention backend's (`AttentionMetadataBuilder.field_sizes`)."""

    def __init__(self, max_seqs: int, backend_fields: dict[str, int], max_logits: int | None = None) -> None:
        sizes = {"query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "logits_idx": max_logits or max_seqs,
                 **backend_fields}
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (start, length)
        at = 0
        for name, n in sizes.items():
            self.offsets[name] = (at, n)  # every start a multiple of ALIGN (see host_copy)
            at += _aligned(n)
        self.size = at


def pack_inputs(a: StepArrays, bucket: int, key: GraphKey | None, layout: SeqLayout,
                builder: AttentionMetadataBuilder) -> tuple[np.ndarray, np.ndarray]:
    """Host images of the step buffers for a step padded to `bucket` tokens: token rows
    [4, bucket] int64 (ids, positions, slots, pending-source rows) and the int32 field
    buffer of `layout`. Padded sequences: an empty query range at T for a mixed step; for
    a uniform key (every sequence q tokens), one query range of q padding tokens each.
    A step that replays a graph (`key`) has the backend's fields too (`fill_for_replay`); an
    eager step's metadata is built once it is loaded (`StepBuffers.metadata`)."""
    T = a.num_tokens
    tokens = np.zeros((4, bucket), dtype=np.int64)
    tokens[:, :T] = (a.ids, a.positions, a.slots, a.src_rows)
    tokens[2:, T:] = -1
    seq = np.zeros(layout.size, dtype=np.int32)
    off = layout.offsets

    def put(name: str, values: np.ndarray) -> None:
        start = off[name][0]
        seq[start : start + len(values)] = values

    qsl_start, qsl_len = off["query_start_loc"]
    if key is not None and key.uniform_query_len:
        q = key.uniform_query_len
        seq[qsl_start : qsl_start + qsl_len] = np.minimum(np.arange(qsl_len) * q, bucket)
    else:
        seq[qsl_start : qsl_start + qsl_len] = T
    put("query_start_loc", a.query_start_loc)
    put("seq_lens", a.seq_lens)
    put("logits_idx", a.logits_idx)
    if key is not None:
        builder.fill_for_replay(a.query_start_loc, a.seq_lens, key, put)
    return tokens, seq


class StepBuffers:
    """The device step buffers (fixed addresses): token rows for up to `max_tokens` tokens,
    the int32 field buffer, block tables [max_seqs, max_blocks]. `max_drafts`: the most
    speculative tokens a sequence carries (each adds a row of logits)."""

    def __init__(self, backend: AttentionBackend, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device, max_drafts: int = 0) -> None:
        self.backend, self.device = backend, device
        self.builder = backend.metadata_builder(self.view)  # (its fields: views of self.seq)
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.layout = SeqLayout(max_seqs, self.builder.field_sizes(max_tokens, max_seqs),
                                min(max_seqs * (1 + max_drafts), max(max_tokens, max_seqs)))
        # For a step of n tokens the token rows live at tokens[:4 * n] viewed as [4, n]: one
        # copy of exactly the step's inputs, at the same addresses in every replay.
        self.tokens = torch.zeros(4 * max_tokens, dtype=torch.long, device=device)
        self.seq = torch.zeros(self.layout.size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        # each token row's LoRA slot (-1: the base model; padding rows -1), copied only with LoRA
        self.lora_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

    def fits(self, a: StepArrays) -> bool:
        return (a.num_tokens <= self.max_tokens and a.num_seqs <= self.max_seqs
                and a.tables.shape[1] <= self.max_blocks)

    def view(self, name: str, length: int | None = None) -> torch.Tensor:
        start, n = self.layout.offsets[name]
        return self.seq[start : start + (n if length is None else length)]

    def token_rows(self, n: int) -> torch.Tensor:
        return self.tokens[: 4 * n].view(4, n)  # ids, positions, slots, sources

    def load(self, a: StepArrays, bucket: int, key: GraphKey | None,
             prev_tokens: torch.Tensor | None) -> None:
        """Copy a step's inputs (padded to `bucket` tokens) into the buffers and fill its
        pending input tokens from the previous step's samples on the device."""
        tokens, seq = pack_inputs(a, bucket, key, self.layout, self.builder)
        cuda = self.device.type == "cuda"
        pin = _pinned if cuda else (lambda t: t)
        self.tokens[: tokens.size].copy_(pin(torch.from_numpy(tokens.reshape(-1))), non_blocking=cuda)
        self.seq.copy_(pin(torch.from_numpy(seq)), non_blocking=cuda)
        S, W = a.tables.shape
        self.block_tables[:S, :W].copy_(pin(torch.from_numpy(a.tables)), non_blocking=cuda)
        if a.has_pending:
            rows = self.token_rows(bucket)
            ids, src = rows[0, : a.num_tokens], rows[3, : a.num_tokens]
            if cuda:
                from pagedserve.kernels.step_inputs import fill_pending_tokens

                fill_pending_tokens(ids, src, prev_tokens)
            else:
                pending = src >= 0
                ids[pending] = prev_tokens[src[pending]]

    def load_lora_slots(self, token_slots: np.ndarray, bucket: int) -> None:
        """Copy a step's per-token LoRA slots ([T] int32, `LoRAManager.prepare`), padded with
        -1 up to `bucket` rows."""
        host = np.full(bucket, -1, dtype=np.int32)
        host[: len(token_slots)] = token_slots
        cuda = self.device.type == "cuda"
        self.lora_slots[:bucket].copy_(_pinned(torch.from_numpy(host)) if cuda else torch.from_numpy(host),
                                       non_blocking=cuda)

    def advance_decodes(self, rows: int, tokens: torch.Tensor, block_size: int) -> None:
        """On the device: turn the decode step in the first `rows` token rows (a decode graph's
        bucket: row i is sequence i) into the next one, each sequence's input `tokens[i]`
        ([rows] int64, e.g. the step's argmax) one position on, its KV slot looked up in its
        block table (which must hold it) and its length one more. Padding rows (slot -1)
        keep slot -1 and length 0. No host work: a CUDA graph can hold several steps."""
        ids, positions, slots = self.token_rows(rows)[:3]  # [rows] int64 each
        real = slots >= 0  # [rows]
        ids.copy_(tokens)
        positions.add_(1)
        block = positions // block_size  # [rows]
        block = torch.where(real, block, torch.zeros_like(block))  # (padding rows: any entry)
        page = self.block_tables[:rows].gather(1, block[:, None])[:, 0].long()  # [rows]
        slots.copy_(torch.where(real, page * block_size + positions % block_size, slots))
        self.view("seq_lens", rows).add_(real.int())

    def metadata(self, a: StepArrays) -> CommonAttentionMetadata:
        """The backend's metadata of an eager step over the loaded buffers (exact sizes),
        built once for every layer."""
        S = a.num_seqs
        common = CommonAttentionMetadata(
            query_start_loc=self.view("query_start_loc", S + 1), seq_lens=self.view("seq_lens", S),
            slot_mapping=self.token_rows(a.num_tokens)[2], block_tables=self.block_tables[:S],
            max_query_len=a.max_query_len, max_seq_len=int(a.seq_lens.max()),
            query_start_loc_cpu=a.query_start_loc.tolist(), seq_lens_cpu=a.seq_lens.tolist(),
        )
        return self.builder.build(common)

    def capture_metadata(self, key: GraphKey, max_seq_len: int) -> CommonAttentionMetadata:
        """The backend's static metadata a graph of `key` reads (kernel grids sized for the
        key), over the buffers."""
        num_seqs = key.num_tokens // key.uniform_query_len if key.uniform_query_len else self.max_seqs
        common = CommonAttentionMetadata(
            query_start_loc=self.view("query_start_loc", num_seqs + 1),
            seq_lens=self.view("seq_lens", num_seqs),
            slot_mapping=self.token_rows(key.num_tokens)[2], block_tables=self.block_tables[:num_seqs],
            max_query_len=key.uniform_query_len or key.num_tokens, max_seq_len=max_seq_len,
            query_start_loc_cpu=[], seq_lens_cpu=[],
        )
        return self.builder.build_for_capture(common, key)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()
