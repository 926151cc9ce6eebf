"""Tensor parallelism over torch.distributed: the ranks' processes and their group (the collectives the model
calls are in mili/distributed.py).

Rank 0 is the process that schedules (the engine core, or the offline ``LLM``'s process): its
``ModelRunner`` joins the group (``TensorParallelGroup.join``), starting ranks 1..N-1 on this node (``start_workers``),
each a process (``worker_main``) with a ``ModelRunner`` over its own shard of the weights and of the KV cache (the
same pages, its KV heads).
Every step rank 0 broadcasts the batch it built; all ranks run the model, meeting in one all-reduce after
each attention output and each MLP/experts block and in one all-gather of the sampled rows' logits; rank
0 samples. gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

from mili.process import die_with_parent
from mili.runtime.prompt_logprobs import step_logits

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


def leave_group() -> None:
    """Leave this process's group, if it joined one (torchrun's rank 0, its command done): gloo's threads are joined
    here, in order. Left to the interpreter's exit, their teardown could abort the process (std::terminate: SIGABRT,
    1 run in 8 of `mili generate` under torchrun on a 2-core machine), which torchrun reports as a failed rank. The
    other ranks were told to stop by the engine's shutdown; where the command failed before it, they see the group
    close and exit (worker_main)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start_workers(runner_class, config, model_config, path: str) -> tuple[list, str]:
    """Start ranks 1..N-1 of ``config.tensor_parallel_size`` on this node, each running ``worker_main(runner_class,
    config, model_config, path, rank, address, parent_pid)``; (their processes, the group's address)."""
    import multiprocessing

    address = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, config.tensor_parallel_size):
        proc = ctx.Process(target=worker_main, args=(runner_class, config, model_config, path, rank, address,
                                                        os.getpid()),
                           name=f"mili-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs, address


def broadcast(obj):
    """Rank 0's ``obj`` on every rank (pickled; a step's batch is small next to its model work)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TensorParallelGroup:
    """This process's place among the tensor-parallel ranks (a group of one without tensor parallelism: nothing to
    send, no one to stop). Rank 0 starts the other ranks (torchrun's, where it started them), sends them its page
    and state copies and each step's batch (``send``), checks and stops them; a rank > 0 runs what it sends
    (``serve``)."""

    def __init__(self, size: int = 1, rank: int = 0, workers: list | None = None):
        self.size, self.rank, self.workers = size, rank, workers or []

    @classmethod
    def join(cls, runner_class, config, model_config, path: str, rank: int = 0, address: str | None = None):
        """(the group of ``config.tensor_parallel_size`` ranks, joined; this rank's shard of ``model_config``; its
        device). Rank 0 starts the others' processes (``runner_class`` each, on its shard) where torchrun did not."""
        size, device = config.tensor_parallel_size, config.torch_device
        if size == 1:
            return cls(), model_config, device
        shard, workers = model_config.shard(rank, size), []  # one that cannot be split fails before anything starts
        if rank == 0 and torchrun_rank() is not None:
            address = "env://"  # the other ranks are torchrun's processes
        elif rank == 0:
            workers, address = start_workers(runner_class, config, model_config, path)
        device = rank_device(device, rank)
        init_group(rank, size, address, device)
        return cls(size, rank, workers), shard, device

    def send(self, msg) -> None:
        """Rank 0: ``msg`` to the other ranks (``serve`` runs it there); nothing with one rank or on the others."""
        if self.size > 1 and self.rank == 0:
            broadcast(msg)

    @torch.inference_mode()
    def serve(self, parts) -> None:
        """A rank > 0: run what rank 0 sends (page and state copies, model steps) on its runner's ``parts``
        (``RunnerParts``), until it sends None."""
        while True:
            msg = broadcast(None)
            if msg is None:
                return
            if msg[0] == "copy":
                parts.memory.copy_pages(msg[1])
            elif msg[0] == "states":
                parts.states.copy(msg[1])
            else:
                step_logits(parts.model, parts.run_model(msg[1]), msg[1], parts.model_config.vocab_size)

    def check_workers(self) -> None:
        """Raise if another rank's process has exited (the model cannot run without it)."""
        for rank, proc in enumerate(self.workers, 1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")

    def close(self) -> None:
        """Stop the other ranks (rank 0, tensor parallelism: its own processes or torchrun's, which would otherwise
        see the group's socket close under them); nothing to do otherwise."""
        if self.size > 1 and self.rank == 0:
            try:
                broadcast(None)
            except Exception:
                pass
            self.size = 1  # (closed: nothing more to send)
        for proc in self.workers:
            proc.join(timeout=10)
        self.workers = []


def worker_main(runner_class, config, model_config, path: str, rank: int, address: str, parent_pid: int) -> None:
    """A tensor-parallel rank > 0: build its runner (``runner_class``: joining the group, loading its shard), then run
    the steps rank 0 sends until it says stop or goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_rank_device(config.torch_device, rank)
    runner = runner_class(config, model_config, path, rank=rank, address=address)
    try:
        runner.tp.serve(runner.parts)
    except Exception as e:  # rank 0 went away (its socket closed): nothing left to serve
        log.info("tensor-parallel rank %d stops: %s", rank, e)
    # out at once, the log flushed: the group's gloo threads torn down at the interpreter's exit, with rank 0 gone,
    # could abort the process (std::terminate: SIGABRT), which torchrun reports as a failed rank
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
