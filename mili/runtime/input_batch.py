"""The input-batch builder: a step's ``ForwardBatch`` from the scheduler's ``ScheduledSeq`` list: token ids and
positions (drafts included), each token's KV slot through its sequence's page table, the rows whose final hidden
states are wanted (sampled tokens, verified drafts, pooling requests' last tokens, scored prompt positions), the
recurrent-state slots of a hybrid, and the image rows and M-RoPE positions of a step with images."""

from __future__ import annotations

import itertools

import torch

from mili.model.batch import ForwardBatch
from mili.runtime.images import StepImages


class InputBatchBuilder:
    """``device_lens``: the lengths also as device tensors (the Triton kernels read them there); ``model``,
    ``encoder_cache`` and ``tokens_per_call``: the vision tower's, for steps with images."""

    def __init__(self, device: torch.device, page_size: int, hybrid: bool, device_lens: bool, model=None,
                 encoder_cache=None, tokens_per_call: int = 0):
        self.device, self.page_size, self.hybrid, self.device_lens = device, page_size, hybrid, device_lens
        self.model, self.encoder_cache, self.tokens_per_call = model, encoder_cache, tokens_per_call

    def prepare(self, scheduled) -> tuple[ForwardBatch, list[tuple]]:
        """Batch tensors for a list of ``ScheduledSeq`` (decodes first), built once per step; and the
        prompt positions each sequence scores in it (prompt logprobs): [(sequence, positions)]."""
        input_ids, positions, query_lens, context_lens, logits_indices = [], [], [], [], []
        pool_rows, pooling, prompt_rows, scoring = [], [], [], []
        num_decodes = 0
        # M-RoPE positions and image rows, only when a request with images is in the step
        images = StepImages(self.model, self.encoder_cache, self.tokens_per_call) \
            if any(s.seq.request.images is not None for s in scheduled) else None
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start, first_row = seq.num_computed_tokens, len(input_ids)
            if images is not None:
                images.add(seq.request.images, start, n, first_row)
            input_ids += seq.token_ids[start:start + n - len(s.draft)] + s.draft
            positions += range(start, start + n)
            query_lens.append(n)
            context_lens.append(start + n)
            num_decodes += n == 1
            if s.samples:  # logits only where a token is sampled (and each draft verified), and where a
                logits_indices += range(len(input_ids) - len(s.draft) - 1, len(input_ids))  # prompt token is scored
            elif s.pools:  # (and where a pooling request's last token is)
                pool_rows.append(len(input_ids) - 1)
                pooling.append(seq.params.pooling)
            unscored = seq.request.unscored(start, start + n)
            if unscored:
                prompt_rows += range(first_row + unscored.start - start, first_row + unscored.stop - start)
                scoring.append((seq, unscored))
        dev = self.device
        batch = self.forward_batch(
            [s.seq.page_table for s in scheduled], positions, query_lens, context_lens,
            torch.tensor(input_ids, dtype=torch.long, device=dev), num_decodes=num_decodes,
            logits_indices=torch.tensor(logits_indices + pool_rows + prompt_rows, dtype=torch.long, device=dev),
            num_prompt_rows=len(prompt_rows), num_pool_rows=len(pool_rows), pooling=pooling or None,
            state_slots=[s.seq.state_slot for s in scheduled] if self.hybrid else None)
        if images is not None:  # (the slots stay the tokens' indices; the rotary takes M-RoPE's positions)
            batch.positions, batch.images = images.batch_fields(dev)
        return batch, scoring

    def forward_batch(self, page_tables: list[list[int]], positions: list[int], query_lens: list[int],
                       context_lens: list[int], input_ids: torch.Tensor, **fields) -> ForwardBatch:
        """A ForwardBatch over sequences' ``page_tables`` (padded to one width), each token's KV slot from its
        position, and the lengths the Triton kernels read from device tensors; ``fields``: the rest."""
        page_size, dev = self.page_size, self.device
        max_pages = max(len(t) for t in page_tables)
        page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in page_tables], dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        seq_of_token = torch.arange(len(page_tables))  # (a token a sequence: decodes)
        if len(positions) != len(page_tables):
            seq_of_token = torch.repeat_interleave(seq_of_token, torch.tensor(query_lens))
        slots = page_table[seq_of_token, pos // page_size] * page_size + pos % page_size
        kernel_lens = {}
        if self.device_lens:
            starts = [0, *itertools.accumulate(query_lens[:-1])]
            kernel_lens = {name: torch.tensor(values, dtype=torch.int32, device=dev) for name, values in
                           (("context_lens_t", context_lens), ("query_lens_t", query_lens), ("query_start_t", starts))}
        return ForwardBatch(input_ids=input_ids, positions=pos.to(dev), slot_mapping=slots.to(dev),
                            page_table=page_table.to(dev), query_lens=query_lens, context_lens=context_lens,
                            **kernel_lens, **fields)

    def one_token_batch(self, page_tables: list[list[int]], positions: list[int],
                         input_ids: torch.Tensor) -> ForwardBatch:
        """A batch of one new token per sequence, at ``positions`` over ``page_tables`` (the MTP drafts')."""
        n = len(positions)
        return self.forward_batch(page_tables, positions, [1] * n, [p + 1 for p in positions], input_ids,
                                   num_decodes=n, logits_indices=torch.arange(n, device=self.device))
