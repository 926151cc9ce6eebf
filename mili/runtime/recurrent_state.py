"""The hybrid models' recurrent states on the device: for each linear-attention (Gated DeltaNet) layer, a
conv state [rows, conv_dim, K - 1] in the model's dtype and an SSM state [rows, Hv, Dk, Dv] in
``mamba_ssm_dtype`` (float32 unless the checkpoint says otherwise). Rows 0 .. slots - 1 are the running
sequences' slots (bookkept by the engine core's StatePool, cache/state_pool.py); the rows after them are the prefix
cache's snapshots (its SnapshotPool, cache/snapshot_pool.py), never read by a step: a hit copies one into a slot. With
``scratch`` one more row follows, no sequence's: CUDA graphs' padding rows read and write it. Speculative
decoding adds ``num_spare`` rows: a step copies each drafting sequence's state into one before it runs, and
back when a draft is rejected (the chunk is then recomputed: a recurrent state cannot step back).
With tensor parallelism each rank holds its own heads' states (``model_config`` is the rank's shard), in rows
numbered alike on every rank: rank 0's pools decide, and its copies are broadcast (ModelRunner.copy_states)."""

from __future__ import annotations

import logging

import torch

from mili import host_memory
from mili.config import ModelConfig
from mili.host_copy import tensor_on
from mili.model.qwen3_5 import LinearAttentionShape, ssm_state_dtype

log = logging.getLogger("mili")


class RecurrentStateCache:
    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device, num_slots: int,
                 num_snapshots: int = 0, scratch: bool = False, num_spare: int = 0):
        shape = LinearAttentionShape.of(model_config.hf_config, model_config.tp_size)
        self.ssm_dtype = ssm_state_dtype(model_config.hf_config)
        self.num_layers = model_config.layer_types.count("linear_attention")
        rows = num_slots + num_snapshots
        self.scratch_row = rows if scratch else None
        rows += int(scratch)
        self.spare_rows = list(range(rows, rows + num_spare))
        rows += num_spare
        self.caches = [(host_memory.zeros((rows, *shape.conv_state_shape()), dtype, device),
                        host_memory.zeros((rows, *shape.ssm_state_shape()), self.ssm_dtype, device))
                       for _ in range(self.num_layers)]
        self.num_slots, self.num_snapshots = num_slots, num_snapshots  # (the engine core's pools hand them out)
        self.device = device
        self.bytes_per_slot = self.slot_bytes(model_config, dtype)
        log.info("recurrent state: %d slots + %d prefix-cache snapshots of %.2f MiB each (%d linear-attention "
                 "layers, SSM state in %s), %.1f MiB", num_slots, num_snapshots, self.bytes_per_slot / 2**20,
                 self.num_layers, str(self.ssm_dtype).removeprefix("torch."), self.num_bytes / 2**20)

    @staticmethod
    def slot_bytes(model_config: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's state over every linear-attention layer."""
        shape = LinearAttentionShape.of(model_config.hf_config, model_config.tp_size)
        conv, ssm = shape.conv_state_shape(), shape.ssm_state_shape()
        per_layer = (conv[0] * conv[1] * dtype.itemsize
                     + ssm[0] * ssm[1] * ssm[2] * ssm_state_dtype(model_config.hf_config).itemsize)
        return model_config.layer_types.count("linear_attention") * per_layer

    @property
    def num_bytes(self) -> int:
        """Slots, snapshots and the scratch row together (all come out of the KV budget)."""
        rows = (self.num_slots + self.num_snapshots + (self.scratch_row is not None)
                + len(self.spare_rows))
        return rows * self.bytes_per_slot

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy states row to row ((src, dst) pairs: slots or snapshots) in every layer."""
        if not copies:
            return
        src = tensor_on([s for s, _ in copies], self.device)
        dst = tensor_on([d for _, d in copies], self.device)
        for conv, ssm in self.caches:
            conv[dst], ssm[dst] = conv[src], ssm[src]
