"""A tensor-parallel rank > 0 started by rank 0 (see :mod:`quickdraft.parallel.launch`)."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from quickdraft.errors import QuickdraftError
from quickdraft.parallel.launch import init_group, load_shard
from quickdraft.parallel.tp import TPCausalLM, worker_loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quickdraft.parallel.worker")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="tcp://host:port of rank 0")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    device, ctrl = init_group(args.rank, args.world, args.device, args.init)
    model = load_shard(args.model, args.dtype, device, args.max_context, args.rank, args.world, ctrl).model
    assert isinstance(model, TPCausalLM)
    dist.barrier()  # every rank holds its shard
    worker_loop(model)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
