"""The input-batch builder: a step's ``ForwardBatch`` from the scheduler's ``ScheduledSeq`` list: token ids and
positions (drafts included), each token's KV slot through its sequence's page table, the rows whose final hidden
states are wanted (sampled tokens, verified drafts, pooling requests' last tokens, scored prompt positions), the
recurrent-state slots of a hybrid, and the image rows and M-RoPE positions of a step with images."""

from __future__ import annotations

import itertools

import torch

from mili.host_copy import to_device
from mili.model.batch import ForwardBatch
from mili.runtime.images import StepImages


class InputBatchBuilder:
    """``device_lens``: the lengths also as device tensors (the Triton kernels read them there); ``model``,
    ``encoder_cache`` and ``tokens_per_call``: the vision tower's, for steps with images."""

    def __init__(self, device: torch.device, page_size: int, hybrid: bool, device_lens: bool, model=None,
                 encoder_cache=None, tokens_per_call: int = 0, max_num_seqs: int = 256, max_pages_per_seq: int = 1):
        self.device, self.page_size, self.hybrid, self.device_lens = device, page_size, hybrid, device_lens
        self.model, self.encoder_cache, self.tokens_per_call = model, encoder_cache, tokens_per_call
        self.tables = PageTables(2 * max_num_seqs, max_pages_per_seq, device)

    def prepare(self, scheduled, feed=None) -> tuple[ForwardBatch, list[tuple]]:
        """Batch tensors for a list of ``ScheduledSeq`` (decodes first), built once per step; and the
        prompt positions each sequence scores in it (prompt logprobs): [(sequence, positions)].

        ``feed``: (ids, {sequence: row}): the previous step's draw, still on the device, for the sequences whose
        last token is not on the host yet (``Sequence.pending_at``): their input rows take ``ids[row]`` there."""
        input_ids, positions, query_lens, context_lens, logits_indices = [], [], [], [], []
        fed_rows, fed_from = [], []
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
            if feed is not None and seq in feed[1]:
                fed_rows.append(first_row + seq.pending_at - start)
                fed_from.append(feed[1][seq])
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
        ids = to_device(torch.tensor(input_ids, dtype=torch.long), dev)
        if fed_rows:
            ids[to_device(torch.tensor(fed_rows), dev)] = feed[0][to_device(torch.tensor(fed_from), dev)]
        batch = self.forward_batch(
            self.tables.rows([s.seq for s in scheduled], self.page_size), positions, query_lens, context_lens, ids,
            num_decodes=num_decodes,
            logits_indices=to_device(torch.tensor(logits_indices + pool_rows + prompt_rows, dtype=torch.long), dev),
            num_prompt_rows=len(prompt_rows), num_pool_rows=len(pool_rows), pooling=pooling or None,
            state_slots=[s.seq.state_slot for s in scheduled] if self.hybrid else None)
        if images is not None:  # (the slots stay the tokens' indices; the rotary takes M-RoPE's positions)
            batch.positions, batch.images = images.batch_fields(dev)
        return batch, scoring

    def forward_batch(self, page_table: torch.Tensor, positions: list[int], query_lens: list[int],
                       context_lens: list[int], input_ids: torch.Tensor, **fields) -> ForwardBatch:
        """A ForwardBatch over the sequences' ``page_table`` rows (on the device), each token's KV slot from its
        position (computed there), and the lengths the Triton kernels read from device tensors; ``fields``: the
        rest."""
        page_size, dev = self.page_size, self.device
        pos = to_device(torch.tensor(positions, dtype=torch.long), dev)
        seq_of_token = torch.arange(len(query_lens))  # (a token a sequence: decodes)
        if len(positions) != len(query_lens):
            seq_of_token = torch.repeat_interleave(seq_of_token, torch.tensor(query_lens))
        slots = page_table[to_device(seq_of_token, dev), pos // page_size] * page_size + pos % page_size
        kernel_lens = {}
        if self.device_lens:
            starts = [0, *itertools.accumulate(query_lens[:-1])]
            kernel_lens = {name: to_device(torch.tensor(values, dtype=torch.int32), dev) for name, values in
                           (("context_lens_t", context_lens), ("query_lens_t", query_lens), ("query_start_t", starts))}
        return ForwardBatch(input_ids=input_ids, positions=pos, slot_mapping=slots, page_table=page_table,
                            query_lens=query_lens, context_lens=context_lens, **kernel_lens, **fields)

    def one_token_batch(self, page_tables: list[list[int]], positions: list[int],
                         input_ids: torch.Tensor) -> ForwardBatch:
        """A batch of one new token per sequence, at ``positions`` over ``page_tables`` (the MTP drafts')."""
        n = len(positions)
        width = max(len(t) for t in page_tables)
        table = to_device(torch.tensor([t + [0] * (width - len(t)) for t in page_tables], dtype=torch.long),
                          self.device)
        return self.forward_batch(table, positions, [1] * n, [p + 1 for p in positions], input_ids,
                                   num_decodes=n, logits_indices=torch.arange(n, device=self.device))


class PageTables:
    """The running sequences' page tables as rows of one persistent tensor on the device, [rows, max_pages]: a
    sequence keeps its row while it runs, and a step writes only the entries that changed since its last one (new
    pages; the page a copy-on-write replaced; a whole table that was replaced, after a preemption or a prefix-cache
    start), then gathers its sequences' rows. Nothing is rebuilt per token that lasts a request.

    A row is a sequence's until no row is free: then every sequence not in the step gives its row back (one still
    running is written anew when it comes back; there are twice ``max_num_seqs`` rows, so that is rare). Past a
    table's end a row holds some page id it held before (or 0): never read, as attention stops at the context. The
    table a row mirrors is tracked by identity: the scheduler replaces a sequence's list when it starts it afresh,
    and changes it in place otherwise (appends, the copy-on-write of its last computed page, a cut after rejected
    drafts)."""

    def __init__(self, num_rows: int, max_pages: int, device: torch.device):
        self.table = torch.zeros(num_rows, max_pages, dtype=torch.long, device=device)
        self.device = device
        self.free = list(range(num_rows - 1, -1, -1))
        self.mirror: dict = {}  # sequence -> (its row, the list written there, how many entries were written)

    def rows(self, seqs: list, page_size: int) -> torch.Tensor:
        """[len(seqs), the longest table] page ids, each sequence's row brought up to date first."""
        rows, where, cols, values = [], [], [], []
        for seq in seqs:
            pages = seq.page_table
            known = self.mirror.get(seq)
            if known is None:
                row, start = self._row(seqs), 0
            elif known[1] is not pages:  # (replaced: written anew)
                row, start = known[0], 0
            else:  # (a copy-on-write replaces the page its next token goes into, where its computed tokens end)
                row, start = known[0], min(known[2], seq.num_computed_tokens // page_size)
            if start < len(pages):
                where += [row] * (len(pages) - start)
                cols += range(start, len(pages))
                values += pages[start:]
            self.mirror[seq] = (row, pages, len(pages))
            rows.append(row)
        if values:
            self.table[to_device(torch.tensor(where), self.device), to_device(torch.tensor(cols), self.device)] = \
                to_device(torch.tensor(values, dtype=torch.long), self.device)
        width = max(len(seq.page_table) for seq in seqs)
        return self.table.index_select(0, to_device(torch.tensor(rows), self.device))[:, :width]

    def _row(self, step: list) -> int:
        if not self.free:  # the rows of every sequence not in this step go back (one still running is written anew)
            keep = set(step)
            for seq in [s for s in self.mirror if s not in keep]:
                self.free.append(self.mirror.pop(seq)[0])
        return self.free.pop()
