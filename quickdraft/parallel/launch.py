"""Starting a tensor-parallel model: under ``torchrun``, or by spawning the other ranks ourselves.

* ``torchrun --nproc-per-node N -m quickdraft generate --tensor-parallel N ...``: every process
  runs the CLI; rank 0 continues as usual, ranks > 0 load their shard, replay rank 0's passes and
  exit when it is done (they never return from :func:`load_tensor_parallel`).
* ``quickdraft serve --tensor-parallel N`` / ``LLM(..., tensor_parallel=N)`` without torchrun: the
  calling process becomes rank 0 and starts ranks 1..N-1 as ``python -m quickdraft.parallel.worker``
  on a free loopback port; they stop when rank 0 exits.

Backend: gloo on CPU, NCCL on CUDA (with a gloo group for the control messages). Each process
loads the whole checkpoint, then keeps its shard.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.parallel.tp import TPCausalLM, shard_model, worker_loop

TIMEOUT = timedelta(hours=12)  # an idle server must not time its workers out


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, world: int, device: str, init_method: str | None = None) -> tuple[str, dist.ProcessGroup | None]:
    """Join the process group; returns this rank's device and the control group (None = default)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, init_method=init_method or "env://", timeout=TIMEOUT)
    ctrl = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
    return device, ctrl


def load_shard(
    spec: str, dtype: str, device: str, max_context: int | None, rank: int, world: int, ctrl: dist.ProcessGroup | None
) -> LoadedModel:
    loaded = load_model(spec, dtype=dtype, device=device, max_context=max_context)
    loaded.model = shard_model(loaded.model, rank, world, ctrl_group=ctrl)
    return loaded


def load_tensor_parallel(
    spec: str, world: int, dtype: str = "auto", device: str = "cpu", max_context: int | None = None, threads: int = 1
) -> LoadedModel:
    """Rank 0's :class:`LoadedModel` of a model split over ``world`` processes."""
    if world < 2:
        raise QuickdraftError(f"--tensor-parallel must be >= 2 to split a model, got {world}")
    run = torchrun_rank()
    if run is not None:
        rank, size = run
        if size != world:
            raise QuickdraftError(f"--tensor-parallel {world} but torchrun started {size} processes; make them equal")
        device, ctrl = init_group(rank, world, device)
        loaded = load_shard(spec, dtype, device, max_context, rank, world, ctrl)
        dist.barrier()
        if rank != 0:
            assert isinstance(loaded.model, TPCausalLM)
            _serve_and_exit(loaded.model)
    else:
        port = _free_port()
        init = f"tcp://127.0.0.1:{port}"
        procs = [
            subprocess.Popen([
                sys.executable, "-m", "quickdraft.parallel.worker", "--model", spec, "--dtype", dtype,
                "--device", device, "--rank", str(r), "--world", str(world), "--init", init,
                "--threads", str(threads), *(["--max-context", str(max_context)] if max_context else []),
            ])
            for r in range(1, world)
        ]
        atexit.register(_reap, procs)
        ready = threading.Event()
        threading.Thread(target=_watch, args=(procs, ready), daemon=True).start()
        device, ctrl = init_group(0, world, device, init)
        loaded = load_shard(spec, dtype, device, max_context, 0, world, ctrl)
        dist.barrier()  # every rank holds its shard
        ready.set()
    model = loaded.model
    assert isinstance(model, TPCausalLM)
    atexit.register(_stop, model)
    return loaded


def _watch(procs: list[subprocess.Popen], ready: threading.Event) -> None:
    """Until every rank has loaded: a worker that dies would leave rank 0 waiting forever."""
    while not ready.wait(0.5):
        for p in procs:
            if p.poll() is not None:
                print(f"error: a tensor-parallel worker exited with code {p.returncode} while loading "
                      "(its error is printed above)", file=sys.stderr, flush=True)
                for q in procs:
                    q.kill()
                os._exit(2)


def _serve_and_exit(model: TPCausalLM) -> None:
    worker_loop(model)
    dist.destroy_process_group()
    sys.exit(0)


def _stop(model: TPCausalLM) -> None:
    if dist.is_initialized():
        try:
            model.stop_workers()
            dist.destroy_process_group()
        except Exception:
            pass


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
