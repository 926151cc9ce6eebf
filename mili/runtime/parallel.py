"""Tensor parallelism over torch.distributed: the ranks' processes and their group (the collectives the model
calls are in mili/distributed.py).

Rank 0 is the process that schedules (the engine core, or the offline ``LLM``'s process): its
``ModelRunner`` starts ranks 1..N-1 on this node (``start_workers``), each a process with a
``ModelRunner`` over its own shard of the weights and of the KV cache (the same pages, its KV heads).
Every step rank 0 broadcasts the batch it built; all ranks run the model, meeting in one all-reduce after
each attention output and each MLP/experts block and in one all-gather of the sampled rows' logits; rank
0 samples. gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

log = logging.getLogger("mili")
COLLECTIVE_TIMEOUT_S = 300  # a rank that stops answering fails the step after this (a dead one: at once)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or a launcher like it, setting RANK and WORLD_SIZE > 1) started
    the ranks; the group then meets at MASTER_ADDR:MASTER_PORT. None otherwise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"])
    return None


def local_rank(rank: int) -> int:
    """The GPU of a rank on its node: LOCAL_RANK under torchrun, else the rank (one node)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: its own GPU on CUDA, the CPU as it is."""
    return torch.device("cuda", local_rank(rank)) if device.type == "cuda" else device


def use_rank_device(device: torch.device, rank: int) -> None:
    """Make a rank's GPU the process's current one (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(local_rank(rank))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, address: str, device: torch.device) -> None:
    """Join the group of ``size`` ranks at ``address`` (tcp://host:port); a previous group of this
    process (an earlier engine's) is left first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def start_workers(worker_main, config, model_config, path: str) -> tuple[list, str]:
    """Start ranks 1..N-1 of ``config.tensor_parallel_size`` on this node, each running ``worker_main(config,
    model_config, path, rank, address, parent_pid)``; (their processes, the group's address)."""
    import multiprocessing

    address = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, config.tensor_parallel_size):
        proc = ctx.Process(target=worker_main, args=(config, model_config, path, rank, address, os.getpid()),
                           name=f"mili-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs, address


def broadcast(obj):
    """Rank 0's ``obj`` on every rank (pickled; a step's batch is small next to its model work)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
