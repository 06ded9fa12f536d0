"""The flat batch one engine step hands to the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from met.kernels.varlen import VarlenMeta


@dataclass(frozen=True)
class WindowPlan:
    """How one attention window applies to every sequence of a step.

    Single-token queries that see their whole kept context (decodes) are gathered into one
    batched call: ``decode_rows`` are their batch rows and request i of them attends over
    ``decode_slots[decode_offsets[i]:decode_offsets[i + 1]]``. Every other sequence (prefill
    chunks, windowed prefixes) is listed in ``per_seq`` with its slots and boolean mask.
    """

    decode_rows: torch.Tensor  # long [N_decode]
    decode_slots: torch.Tensor  # long [sum of decode context lengths]
    decode_offsets: torch.Tensor  # long [N_decode + 1]
    per_seq: list[tuple[SeqSpan, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class PromptChunks:
    """The prompt chunks of a step (batch rows [0, prompt_rows)) for the prompt-attention
    kernel (met.kernels.prompt_attention): per chunk, its first row, its number of rows,
    its context length and where its context's slots start in ``slots``."""

    slots: torch.Tensor  # long: every prompt chunk's context slots, one after another
    bounds: torch.Tensor  # long [n, 4]: q_start, q_len, ctx_len, slot start


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the flat batch.

    Its query tokens are rows [q_start, q_start + q_len) of the batch; they are the last
    q_len of a context of ctx_len tokens whose KV sits at the cache slots ctx_slots.
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor  # long [ctx_len]: flat KV slot of every context position
    # Each query row attends alone through the one-row (decode) kernel: a speculative
    # verify's rows then attend exactly as the decodes they stand for would.
    rows_apart: bool = False
    # The request's prompt length (its positions below it are prompt positions): what a
    # length-dependent rope needs (`ForwardBatch.rope_seq_lens`).
    prompt_len: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    """All tokens of one step, from every scheduled request, as one flat tensor.

    Everything here is computed once per step and shared by all layers; the per-window
    attention masks are memoised on first use for the same reason.
    """

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [T]: flat KV slot (block * block_size + offset) per token
    seqs: tuple[SeqSpan, ...]
    # Every query row, prompt rows too, attends alone through the one-row (decode) kernel:
    # its result is then bitwise the same however its prompt was chunked or batched
    # (CausalLM.row_attention; on for w8a8 and w4a8, whose int8 rounding of activations would
    # turn the prefill kernel's chunk-dependent last bits into different tokens).
    row_attention: bool = False
    # Rows [0, prompt_rows) are prompt positions and every later row a generated one, when
    # the model runs the two through different kernels (CausalLM.prompt_rows_first: the
    # runner then orders prompt chunks first); 0 otherwise.
    prompt_rows: int = 0
    # Per-step values the layers share (attention plans per window, rotary cos/sin at these
    # positions), by key: computed by the first layer that needs them.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def window_plan(self, window: int | None, first_row: int = 0) -> WindowPlan:
        """The attention plan for layers with this sliding window (None = full attention),
        for the sequences whose rows start at ``first_row`` or later (the rows before it are
        prompt chunks attended by `prompt_chunks`' kernel, or none).

        Keys older than the window of a sequence's first query are dropped from its slots.
        """
        key = ("window_plan", window, first_row)
        plan = self.memo.get(key)
        if plan is None:
            seqs = tuple(s for s in self.seqs if s.q_start >= first_row)
            plan = self.memo[key] = _build_plan(seqs, window, self.row_attention)
        return plan

    def rope_seq_lens(self) -> torch.Tensor:
        """Each row's rope length (long [T]) for a length-dependent rope (met.layers.rotary):
        a prompt position takes its request's prompt length, a generated one its own
        length (position + 1), as transformers' generate sees them (the whole prompt in
        one forward, then one token per forward) however the prompt is chunked, batched,
        recomputed after a preemption or verified speculatively."""
        lens = self.memo.get("rope_seq_lens")
        if lens is None:
            prompt = torch.zeros_like(self.positions)
            for s in self.seqs:
                prompt[s.q_start:s.q_start + s.q_len] = s.prompt_len
            lens = self.memo["rope_seq_lens"] = torch.maximum(prompt, self.positions + 1)
        return lens

    def varlen(self) -> VarlenMeta:
        """Every sequence as flat varlen metadata (the Triton attention backend's input)."""
        meta = self.memo.get("varlen")
        if meta is None:
            meta = self.memo["varlen"] = VarlenMeta.build(
                [(s.q_start, s.q_len, s.ctx_len, s.ctx_slots) for s in self.seqs],
                self.input_ids.device)
        return meta

    def prompt_chunks(self) -> PromptChunks:
        """The prompt chunks (rows [0, prompt_rows)) as the prompt-attention kernel takes
        them."""
        chunks = self.memo.get("prompt_chunks")
        if chunks is None:
            spans = [s for s in self.seqs if s.q_start < self.prompt_rows]
            starts = [0]
            for span in spans[:-1]:
                starts.append(starts[-1] + span.ctx_len)
            chunks = self.memo["prompt_chunks"] = PromptChunks(
                slots=torch.cat([s.ctx_slots for s in spans]),
                bounds=torch.tensor([[s.q_start, s.q_len, s.ctx_len, start]
                                     for s, start in zip(spans, starts, strict=True)],
                                    dtype=torch.long))
        return chunks


def _build_plan(seqs: tuple[SeqSpan, ...], window: int | None,
                row_attention: bool = False) -> WindowPlan:
    rows: list[int] = []
    slot_parts: list[torch.Tensor] = []
    offsets = [0]
    per_seq = []
    for span in seqs:
        if (row_attention or span.rows_apart) and span.q_len > 1:
            slots, lengths = _row_slots(span, window)
            rows.extend(range(span.q_start, span.q_start + span.q_len))
            slot_parts.append(slots)
            offsets.extend((offsets[-1] + torch.cumsum(lengths, 0)).tolist())
            continue
        slots, mask = _span_plan(span, window)
        if span.q_len == 1 and mask is None:
            rows.append(span.q_start)
            slot_parts.append(slots)
            offsets.append(offsets[-1] + slots.numel())
        else:
            per_seq.append((span, slots, mask))
    dev = seqs[0].ctx_slots.device if seqs else None
    return WindowPlan(
        decode_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        decode_slots=torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.long),
        decode_offsets=torch.tensor(offsets, dtype=torch.long, device=dev),
        per_seq=per_seq,
    )


def _row_slots(span: SeqSpan, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row of ``span`` as its own one-token query: the concatenated slots of the
    keys every row sees (positions up to its own, within the window) and their counts."""
    dev = span.ctx_slots.device
    q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=dev)
    first = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0)
    lengths = q_pos + 1 - first
    starts = torch.cumsum(lengths, 0) - lengths
    keys = torch.arange(int(lengths.sum()), device=dev) - torch.repeat_interleave(
        starts - first, lengths)
    return span.ctx_slots[keys], lengths


def _span_plan(span: SeqSpan, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    first_q = span.ctx_len - span.q_len
    k_start = 0 if window is None else max(0, first_q - window + 1)
    slots = span.ctx_slots[k_start:] if k_start else span.ctx_slots
    if span.q_len == 1 and (window is None or span.ctx_len - k_start <= window):
        return slots, None  # one query that sees every kept key: no mask needed
    dev = span.ctx_slots.device
    q_pos = torch.arange(first_q, span.ctx_len, device=dev)[:, None]
    k_pos = torch.arange(k_start, span.ctx_len, device=dev)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return slots, mask
