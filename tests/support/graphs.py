"""CUDA graphs without a GPU: ``EagerGraphs``, a ``CudaGraphRunner`` whose capture is an eager forward over the same
static buffers (what a replay computes), so the graph path's batching, padding and buffers run anywhere."""

from __future__ import annotations

from mili.runtime.cuda_graph import CudaGraphRunner


class _EagerReplay:
    """What a captured graph does on replay: the same forward over the same buffers, into the same logits."""

    def __init__(self, forward, batch, logits):
        self.forward, self.batch, self.logits = forward, batch, logits

    def replay(self):
        self.logits.copy_(self.forward(self.batch))


class EagerGraphs(CudaGraphRunner):
    """``replays``: the steps a graph ran (on the class: a test sets it to 0 first)."""

    replays = 0

    def _capture(self, batch):
        # reach-in: the capture replaced by the runner's own eager forward over its static buffers (no GPU here)
        forward = self._forward
        logits = forward(batch)
        return _EagerReplay(forward, batch, logits), logits

    def run(self, batch):
        out = super().run(batch)
        type(self).replays += out is not None
        return out
