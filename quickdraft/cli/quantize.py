"""``quickdraft quantize --fp8 MODEL --out DIR``: write an FP8 (E4M3) copy of a model.

The output is a self-contained Hugging Face folder (config.json with a compressed-tensors
``quantization_config``, model.safetensors, tokenizer files) that ``--model DIR`` loads with
FP8 Linear layers. FP8 is the only format so far; the flag keeps room for others.
"""

from __future__ import annotations

import argparse

from quickdraft.cli.common import info
from quickdraft.cli.models import format_size
from quickdraft.errors import QuickdraftError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="write an FP8 copy of a model as a Hugging Face folder",
        description="Quantize the Linear weights of a model (zoo name, .gguf file or Hugging Face folder; "
        "GGUF weights are dequantized first) to FP8 E4M3 with per-channel or 128x128 block scales, "
        "and write a Hugging Face folder in the compressed-tensors layout.",
    )
    parser.add_argument("model", metavar="MODEL", help="zoo name, .gguf file or Hugging Face folder")
    parser.add_argument("--fp8", action="store_true", help="quantize to FP8 E4M3 (required: the only format so far)")
    parser.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder (created; must be empty)")
    parser.add_argument("--scheme", choices=("channel", "block"), default="channel",
                        help="scales per output channel (default) or per block of --block-size weights")
    parser.add_argument("--block-size", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"),
                        help="block shape for --scheme block (default: 128 128)")
    parser.add_argument("--observer", choices=("minmax", "mse"), default="minmax",
                        help="minmax (default): scale = amax / 448; mse: per channel/block the scale with the "
                             "least squared error (lower weight error, not always lower perplexity; slower)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize the output head too (default: kept in bf16; never when tied to the embedding)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quickdraft.export.fp8 import export_fp8

    if not args.fp8:
        raise QuickdraftError("choose the format to quantize to: --fp8 (the only one so far)")
    rows, cols = args.block_size
    result = export_fp8(
        args.model, args.out, scheme=args.scheme, block=(rows, cols),
        quantize_lm_head=args.quantize_lm_head, observer=args.observer, overwrite=args.overwrite, log=info,
    )
    kept = f"; kept in bf16: {', '.join(result.kept)}" if result.kept else ""
    info(f"{len(result.quantized)} Linear layers in FP8 ({args.scheme}, {args.observer}){kept}; "
         f"{format_size(result.bytes_written)} written")
    print(result.path)
    return 0
