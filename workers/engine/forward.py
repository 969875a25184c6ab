"""The engine's model step: one forward over the scheduled batch, and the tokens it samples.

`ModelStep` is a member of the engine (`Engine.runner`), built over the engine's model side
(model, KV manager, sampler, compiled graphs); a switch to another configuration builds a new
one. The seam is between *what* a step runs and *how*: the engine's loop (engine.py) drains
its inbox, lets the scheduler pick the chunks, applies the stop rules and turns finished
sequences into results (`StepResults`); `ModelStep.run` runs the chunks it is given, with the
engine's KV pools already bound (`Engine._run_model`), on one of three paths:

* a CUDA graph replay (`_run_graph`), when every chunk decodes one token and a captured batch
  size fits (workers/engine/cuda_graphs.py; else it falls through);
* the compiled decode graph (`_run_compiled`, `--compile-decode`, workers/engine/compiled.py),
  for decode-only steps of a batch size it covers, and for prefill and mixed steps of at most
  `compile_max_rows` tokens (every token a row of its own);
* eagerly: the chunks' tokens flattened into one batch with per-group attention metadata
  (block tables from the KV manager), one forward, then the last hidden row of each sampling
  chunk through the sampler (the screened int8 LM head when every sequence is greedy:
  workers/engine/sampling.py). A step with rows to score (teacher forcing,
  `GenerationRequest.score_from`: the cascade's deferral signal) always runs here, the one
  path that keeps every row: `_score_rows` adds each scored token's log-probability to its
  sequence.

Each returns request id -> the tokens sampled after the chunk's sampled rows: one token, or
with draft tokens to check (speculative decoding, workers/engine/speculative.py) the target's
greedy token after its last known token and after each draft, all from one forward (the
scheduler keeps the agreeing prefix). It counts its paths in the engine's `EngineStats`.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata
from workers.engine.compiled import CompiledDecode
from workers.engine.cuda_graphs import CudaGraphDecode
from workers.engine.engine_config import EngineStats
from workers.engine.kv_cache import KVCacheManager
from workers.engine.model import Transformer
from workers.engine.sampling import TokenSampler
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput

__all__ = ["ModelStep"]


class ModelStep:
    """The forward paths of `workers.engine.engine.Engine` (module notes)."""

    def __init__(
        self,
        model: Transformer,
        kv: KVCacheManager,
        device: torch.device,
        sampler: TokenSampler,
        stats: EngineStats,
        compiled: CompiledDecode | None,
        graphs: CudaGraphDecode | None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.sampler = sampler
        self.stats = stats  # the engine's: it outlives a switch, this step does not
        self.compiled = compiled
        self.graphs = graphs

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """The step's forward over the flattened batch and its sampled tokens (pools bound)."""
        if out.block_copies:  # partial prefix hits: their matched slots, before any write
            self.model.copy_kv_blocks(
                [(c.group, c.src, c.dst, c.num_slots) for c in out.block_copies]
            )
        compiled = self.compiled
        decode_only = all(c.samples and c.num_tokens == 1 for c in out.chunks)
        scoring = any(c.scored_rows for c in out.chunks)  # needs every row: the eager path
        if scoring:
            compiled = None
        if self.graphs is not None and decode_only and not scoring:
            picked = self._run_graph(self.graphs, out)
            if picked is not None:
                return picked
        if compiled is not None and (
            compiled.applies(len(out.chunks))  # decode past max_batch stays eager
            if decode_only
            else compiled.applies_rows(sum(c.num_tokens for c in out.chunks))
        ):
            return self._run_compiled(compiled, out, decode_only)
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for c in out.chunks:
            ids.extend(c.input_ids())
            positions.extend(range(c.start, c.start + c.num_tokens))
            query_lens.append(c.num_tokens)
            seq_lens.append(c.start + c.num_tokens)
        metadata = {
            g.name: AttentionMetadata.build(
                query_lens,
                seq_lens,
                [self.kv.block_table(c.seq.request_id, g.name) for c in out.chunks],
                self.kv.block_size,
                self.device,
            )
            for g in self.kv.groups
        }
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, pos, metadata)  # [T, D]
        if scoring:
            self._score_rows(out.chunks, hidden)
        sampling = [c for c in out.chunks if c.samples]
        if not sampling:
            return {}
        ends: list[int] = []
        end = 0
        for c in out.chunks:
            end += c.num_tokens
            ends.extend(range(end - c.num_rows_sampled, end))  # the last row, then drafts'
        rows = hidden.index_select(0, torch.tensor(ends, device=self.device))  # [R, D]
        return self._pick(sampling, rows)

    def _score_rows(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Teacher forcing (`GenerationRequest.score_from`): add the log-probability of each
        scored prompt token, read from the row before it, to its sequence's running sum."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[ScheduledChunk, int]] = []  # (chunk, number of its rows)
        offset = 0
        for c in chunks:
            positions = c.scored_rows
            if positions:
                rows.extend(offset + p - c.start for p in positions)
                targets.extend(c.seq.token_ids[p + 1] for p in positions)
                owners.append((c, len(positions)))
            offset += c.num_tokens
        index = torch.tensor(rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [R, V] float32
        picked = torch.log_softmax(logits, dim=-1).gather(
            1, torch.tensor(targets, device=self.device)[:, None]
        )  # [R, 1]
        values = picked[:, 0].tolist()
        for c, n in owners:
            c.seq.logprob_sum += sum(values[:n])
            c.seq.num_scored += n
            del values[:n]

    def _pick(self, chunks: list[ScheduledChunk], rows: torch.Tensor) -> dict[str, list[int]]:
        """The sampled tokens of the sampling chunks' rows `rows` [R, D] (each chunk's
        `num_rows_sampled` rows in turn), eager or compiled."""
        seqs = [c.seq for c in chunks]
        if self.sampler.screens(seqs):
            self.stats.screened_steps += 1  # greedy only: no logits needed
        if len(chunks) == rows.shape[0]:  # no drafts: one row per sequence
            return {rid: [tok] for rid, tok in self.sampler.pick(seqs, rows).items()}
        # drafts (greedy sequences only) are checked by the argmax; a sampling sequence beside
        # them draws its token as ever
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.num_rows_sampled)
        greedy = [  # checked by the argmax; a sequence keeping log-probabilities goes as drawn
            i
            for i, c in enumerate(chunks)
            if c.seq.request.params.temperature <= 0 and not c.seq.request.params.logprobs
        ]
        picked: dict[str, list[int]] = {}
        if greedy:
            rows_of = [r for i in greedy for r in range(starts[i], starts[i + 1])]
            tokens = self.sampler.argmax(rows[rows_of] if len(rows_of) < len(rows) else rows)
            flat = tokens.tolist()
            for i in greedy:
                picked[chunks[i].seq.request_id] = flat[: chunks[i].num_rows_sampled]
                del flat[: chunks[i].num_rows_sampled]
        drawn = sorted(set(range(len(chunks))) - set(greedy))
        if drawn:
            one_row = rows[[starts[i] for i in drawn]]  # no drafts: one row each
            sampled = self.sampler.pick([seqs[i] for i in drawn], one_row)
            picked.update((rid, [tok]) for rid, tok in sampled.items())
        return picked

    def _run_compiled(
        self, compiled: CompiledDecode, out: SchedulerOutput, decode_only: bool
    ) -> dict[str, list[int]]:
        """A step through the compiled graph, every token a row of its own: a decode step's
        rows are its sequences; a prefill chunk's rows share its block table. The graph gives
        the hidden rows of the sequences that sample (each sampling chunk's last), picked from
        as an eager step's are."""
        ids: list[int] = []
        positions: list[int] = []
        tables: dict[str, list[list[int]]] = {g.name: [] for g in self.kv.groups}
        sample_rows: list[int] = []
        sampling: list[ScheduledChunk] = []
        for c in out.chunks:
            ids.extend(c.input_ids())
            positions.extend(range(c.start, c.start + c.num_tokens))
            for g in self.kv.groups:  # each row of the chunk reads the chunk's table
                table = self.kv.block_table(c.seq.request_id, g.name)
                tables[g.name].extend([table] * c.num_tokens)
            if c.samples:  # the last row, then the drafts' rows
                sample_rows.extend(range(len(ids) - c.num_rows_sampled, len(ids)))
                sampling.append(c)
        if decode_only:
            self.stats.compiled_steps += 1
        else:
            self.stats.compiled_rows_steps += 1
        # a step that samples nothing (a prompt's middle chunk) still gathers one row: the
        # graph has no zero-row variant
        rows = compiled(ids, positions, tables, sample_rows or [len(ids) - 1])  # [S, D]
        return self._pick(sampling, rows) if sampling else {}

    def _run_graph(
        self, graphs: CudaGraphDecode, out: SchedulerOutput
    ) -> dict[str, list[int]] | None:
        """A decode-only step replayed as a CUDA graph; None if it fits no captured bucket
        (then it runs eagerly)."""
        seqs = [c.seq for c in out.chunks]
        got = graphs(
            [c.seq.token_ids[c.start] for c in out.chunks],
            [c.start for c in out.chunks],
            {
                g.name: [self.kv.block_table(s.request_id, g.name) for s in seqs]
                for g in self.kv.groups
            },
        )
        if got is None:
            return None
        self.stats.graph_steps += 1
        sampled = self.sampler.sample(seqs, *got)  # the argmax's .tolist(): the step's one sync
        return {rid: [tok] for rid, tok in sampled.items()}
