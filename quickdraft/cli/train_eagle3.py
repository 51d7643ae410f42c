"""``quickdraft train-eagle3``: train an EAGLE-3 draft head for a target model on this machine.

The target reads code (Python's standard library) and chat data (ShareGPT, Alpaca, GSM8K,
rendered with its own chat template; optionally its own answers with --regenerate) once; its
hidden states at three layers and its own next-token predictions are stored under --out/features;
then a one-layer head learns to predict the target's tokens several steps ahead from them
(EAGLE-3's training-time test). The head is written to --out as config.json + model.safetensors
(Hugging Face EAGLE-3 layout, bf16), next to train_log.json. Interrupted runs continue with
--resume. HumanEval and MT-bench are refused as training data: the benchmark reports on them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quickdraft.cli.common import add_engine_flags, info
from quickdraft.config import DEVICES, DTYPE_CHOICES
from quickdraft.errors import QuickdraftError
from quickdraft.train.data import SOURCES
from quickdraft.train.eagle3 import LOSSES, SCHEDULES, TRAIN_DTYPES, TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-eagle3", help="train an EAGLE-3 draft head for a target model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target and output")
    g.add_argument("--target", "-m", required=True, help="target model: zoo name, .gguf file or model folder")
    g.add_argument("--out", required=True, type=Path, help="output folder (head, features, checkpoints, log)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out with the same options")
    g.add_argument("--dtype", default="float32", choices=[d for d in DTYPE_CHOICES if d != "auto"],
                   help="the target's dtype while capturing features (default: float32; GGUF weights "
                        "dequantize exactly, so the features are those the quantized model computes)")
    g.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICES) + "}",
                   help="where the target's capture, the head, the batches and the optimizer run: cpu, cuda "
                        "(or cuda:N), or auto = cuda when available, else cpu (default: auto); a run may be "
                        "resumed on another device")
    add_engine_flags(g, ("threads",))
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib,sharegpt,alpaca",
                   help=f"comma-separated sources from {', '.join(SOURCES)} (default: stdlib,sharegpt,alpaca)")
    g.add_argument("--max-tokens", type=int, default=200_000, help="training tokens to collect (default: 200000)")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per sequence at most (default: 512)")
    g.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="let the target answer the first N chat prompts itself (greedy; default: 0)")
    g.add_argument("--regen-max-tokens", type=int, default=384, help="answer length cap for --regenerate")
    g.add_argument("--topk", type=int, default=8, help="target top-k log-probabilities stored per position")
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default: 8192)")
    g.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    g.add_argument("--aux-layers", default=None,
                   help="comma-separated target layers whose INPUT hidden states feed the head "
                        "(default: 2,L//2,L-3; taken in layer order)")
    d = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=d.epochs, help=f"passes over the data (default: {d.epochs})")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per step (default: {d.batch_size})")
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate, AdamW (default: {d.lr})")
    g.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help=f"after warmup (default: {d.schedule})")
    g.add_argument("--warmup", type=float, default=d.warmup, help=f"share of steps warming up (default: {d.warmup})")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clipping")
    g.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help=f"training-time-test unroll steps (default: {d.ttt_steps}; the paper uses 7)")
    g.add_argument("--step-weight", type=float, default=d.step_weight,
                   help=f"loss weight decay per unroll step (default: {d.step_weight})")
    g.add_argument("--loss", default=d.loss, choices=LOSSES,
                   help="ce: cross-entropy to the target's argmax (default); kl: to its top-k distribution")
    g.add_argument("--eval-fraction", type=float, default=d.eval_fraction,
                   help=f"share of sequences held out for the final accuracy (default: {d.eval_fraction})")
    g.add_argument("--train-dtype", default=d.train_dtype, choices=TRAIN_DTYPES,
                   help="precision of the head's forward while training: float32 (default) or bfloat16 "
                        "(autocast: bf16 matmuls, float32 weights and optimizer; faster on CPUs with "
                        "AVX-512 BF16/AMX and on GPUs)")
    g.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    g.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=run)


def _aux_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        # in layer order: the order vLLM and SGLang (and quickdraft's loader) fuse them in
        return tuple(sorted(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise QuickdraftError(f"--aux-layers must be comma-separated layer numbers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from quickdraft.api import configure_threads
    from quickdraft.train.pipeline import RunOptions
    from quickdraft.train.pipeline import run as run_pipeline

    for name in ("max_tokens", "seq_len", "topk", "draft_vocab", "regen_max_tokens"):
        if getattr(args, name) < 1:
            raise QuickdraftError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise QuickdraftError(f"--intermediate-size must be at least 1, got {args.intermediate_size}")
    train = TrainConfig(
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, warmup=args.warmup,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, ttt_steps=args.ttt_steps,
        step_weight=args.step_weight, loss=args.loss, eval_fraction=args.eval_fraction,
        save_every=args.save_every, seed=args.seed, train_dtype=args.train_dtype,
    )
    opts = RunOptions(
        target=args.target, out=args.out.expanduser(), data=args.data, max_tokens=args.max_tokens,
        seq_len=args.seq_len, regenerate=args.regenerate, regen_max_tokens=args.regen_max_tokens, topk=args.topk,
        aux_layers=_aux_layers(args.aux_layers), draft_vocab=args.draft_vocab,
        intermediate_size=args.intermediate_size, dtype=args.dtype, device=args.device, train=train,
        resume=args.resume,
    )
    configure_threads(args.threads)
    report = run_pipeline(opts, log=info, progress=not args.quiet)
    t = report.summary["training"]
    acc = t["eval_accuracy_per_step"] or t["train_accuracy_per_step"]
    which = "held-out" if t["eval_accuracy_per_step"] else "training"
    info(f"{which} top-1 accuracy per draft position: " + ", ".join(f"{a:.1%}" for a in acc))
    info(f"head: {report.out} ({report.head_bytes / 1e6:.1f} MB); log: {report.out / 'train_log.json'}")
    print(report.out)
    return 0
