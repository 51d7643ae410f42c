"""``quickdraft bench``: measure output tokens/s per user, every method side by side in one run.

Methods run interleaved, prompt by prompt, after one warm-up request each, on the same prompts
with the same seeds; an OpenAI-compatible endpoint (quickdraft serve, llama.cpp, vLLM, SGLang) can
join as one more contender. Writes bench.json, bench.md and bench.png to --out.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from quickdraft.cli.common import DEFAULT_MODEL, add_engine_flags, info
from quickdraft.errors import QuickdraftError

DEFAULT_METHODS = "none,ngram,auto"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark tokens/s per user: drafting methods and endpoints side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_measure_args(p)
    _add_endpoint_args(p)
    _add_prompt_args(p)
    _add_output_args(p)
    p.set_defaults(func=run)


def _add_measure_args(p: argparse.ArgumentParser) -> None:
    """The target, the methods and the engine options they run with."""
    g = p.add_argument_group(
        "what to measure",
        "engine options apply to the in-process methods as to generate; their prefix cache lets turn n\n"
        "of a conversation reuse what turn n - 1 computed, and every conversation starts cold",
    )
    g.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"target: zoo name, .gguf or folder; endpoints use its tokenizer (default: {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated: none, ngram, draft, auto, eagle3=HEAD (EAGLE-3 trees), eagle3-chain=HEAD "
        f"(default: {DEFAULT_METHODS}; no in-process method when --endpoint is given)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="draft model for the 'draft' method (default: the zoo's pair)",
    )
    add_engine_flags(g, ("draft_vocab", "draft_confidence", "num_draft", "dtype", "max_context", "kv_dtype",
                         "threads", "prefix_cache_mb", "device", "cuda_graphs"))
    g.add_argument(
        "--simulate-acceptance",
        type=float,
        default=None,
        metavar="TAU",
        help="add a drafter that is right often enough to average TAU tokens per pass "
        "(pure overhead at that tau; greedy only; runs after 'none' on each prompt)",
    )


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint (any OpenAI-compatible streaming server)")
    g.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="server URL, e.g. http://127.0.0.1:8000 (repeatable)",
    )
    g.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="NAME",
        help="model name the server expects (one for all endpoints, or one per --endpoint)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="bearer token for the endpoint (never written to the report)",
    )
    g.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait on one request (default: 600)"
    )
    g.add_argument(
        "--concurrency", type=int, default=1, metavar="N",
        help="N users at once, each sending its share of the prompts (endpoints only; serve in-process methods "
        "with 'quickdraft serve --max-concurrency N'): per-user tok/s, TTFT, end-to-end, aggregate tok/s and "
        "answers identical to alone (default: 1, the paired one-user benchmark)",
    )


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts and sampling")
    g.add_argument(
        "--dataset",
        default="humaneval",
        help="humaneval, mtbench, gsm8k, or a JSONL file (default: humaneval)",
    )
    g.add_argument(
        "--num-prompts", type=int, default=10, help="first N prompts of the set (default: 10)"
    )
    g.add_argument(
        "--max-tokens", "-n", type=int, default=256, help="tokens per answer at most (default: 256)"
    )
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--seed", type=int, default=0, help="base seed; prompt i uses seed + i (default: 0)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for bench.json/md/png (default: benchmarks/results/<time>)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up request per method")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:

    from quickdraft.bench import datasets, report, runner
    from quickdraft.bench.metrics import fill_speedups
    from quickdraft.options import EngineOptions

    methods, endpoints = _plan(args)
    if args.concurrency < 1:
        raise QuickdraftError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.concurrency > 1 and methods:
        raise QuickdraftError(
            "--concurrency measures endpoints: start 'quickdraft serve --max-concurrency N' and pass --endpoint "
            "(in-process methods are measured one user at a time)"
        )
    # the engine's options as given (checked here, before anything loads); each method drafts its own way
    opts = runner.MethodOptions(EngineOptions.from_args(args), args.draft_model, args.simulate_acceptance)
    baseline = "none" if "none" in methods else _first_name(methods, endpoints)
    settings = runner.BenchSettings(
        args.max_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        args.ignore_eos,
        warmup=not args.no_warmup,
        baseline=baseline,
    )
    settings.params(0)  # validate sampling before the slow parts
    if opts.simulate_tau is not None:
        runner.simulated_k(opts.simulate_tau, opts.num_draft)
    if "draft" in methods:
        runner.draft_model_for(args.model, opts)
    dataset = datasets.load_dataset(args.dataset, args.num_prompts, progress=not args.no_progress)
    info(
        f"dataset {dataset.name}: {len(dataset.items)} prompts, {dataset.requests_per_method} requests per method"
    )
    if args.concurrency > 1:
        return _run_concurrency(args, methods, endpoints, opts, dataset, settings)
    contenders, model_path, model = _contenders(args, methods, endpoints, opts)
    info(f"measuring {', '.join(c.name for c in contenders)}; speedup over {baseline}")
    before = _bandwidth_probe(model, methods)  # the roofline's bandwidth: probed before and after the runs
    records = runner.run_bench(contenders, dataset, settings, progress=not args.no_progress)
    probes = [before, _bandwidth_probe(model, methods)]
    fill_speedups(records, baseline)
    meta = _meta(args, model_path, dataset, methods, opts)
    result = report.build_report(meta, [c.describe() for c in contenders], records, baseline)
    if model is not None and (roof := _plain_roofline(model, records, probes)) is not None:
        result["roofline"] = {**roof.as_dict(), "line": roof.line()}
    out = args.out or Path("benchmarks") / "results" / datetime.now().strftime("%Y%m%d-%H%M%S")
    paths = report.write_outputs(result, out)
    report.print_table(result)
    if "roofline" in result:
        print(result["roofline"]["line"], flush=True)
    info(f"wrote {paths['json']}, {paths['md']}, {paths['png']}")
    return 0


def _run_concurrency(
    args: argparse.Namespace, methods: list[str], endpoints: list[tuple[str, str]], opts: Any, dataset: Any,
    settings: Any,
) -> int:
    import json

    from quickdraft.bench import concurrency

    contenders, model_path, _ = _contenders(args, methods, endpoints, opts)
    runs = []
    for c in contenders:
        info(f"{c.name}: each prompt alone, then {args.concurrency} users at once ...")
        if settings.warmup:
            c.run(concurrency.first_user_message(dataset.items[0]), settings.params(0), None)
        runs.append(concurrency.run_concurrent(c, dataset, settings, args.concurrency))
    meta = _meta(args, model_path, dataset, methods, opts)
    meta["settings"]["concurrency"] = args.concurrency
    result = {"meta": meta, "runs": [r.summary() for r in runs],
              "requests": [{"contender": r.contender, "user": u.user, "prompt": u.prompt, "ttft": u.ttft,
                            "e2e": u.e2e, "tokens_per_second": u.tokens_per_second,
                            "output_tokens": u.trace.output_tokens, "identical_to_alone": u.identical}
                           for r in runs for u in r.results]}
    out = args.out or Path("benchmarks") / "results" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(result, indent=1) + "\n")
    md = concurrency.markdown(runs, {"command": meta["command"], "created": meta["created"],
                                     "dataset": dataset.name, "max_tokens": args.max_tokens})
    (out / "concurrency.md").write_text(md)
    print(md, flush=True)
    info(f"wrote {out / 'concurrency.json'}, {out / 'concurrency.md'}")
    return 0


def _bandwidth_probe(model: Any, methods: list[str]) -> float | None:
    """The machine's read bandwidth now (GB/s), where a roofline will be printed (plain decoding of
    an in-process model on the CPU); else None."""
    from quickdraft.roofline import read_bandwidth

    if model is None or "none" not in methods or next(model.parameters()).device.type != "cpu":
        return None
    return read_bandwidth()


def _plain_roofline(model: Any, records: list[Any], probes: list[float | None]) -> Any:
    """Plain decoding (method none, median tok/s and context) against the read bandwidth probed
    before and after the runs, or None."""
    from quickdraft.roofline import roofline

    plain = [r for r in records if r.method == "none" and r.tokens_per_second]
    if not plain:
        return None
    tps = statistics.median(r.tokens_per_second for r in plain)
    context = int(statistics.median(r.prompt_tokens + r.output_tokens // 2 for r in plain))
    return roofline(model, tps, context, probes)


def _plan(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, str]]]:
    """The in-process methods and the (url, served model) endpoints, validated."""
    from quickdraft.bench.runner import parse_methods

    default = "" if args.endpoint else DEFAULT_METHODS
    methods = parse_methods(default if args.methods is None else args.methods)
    served = args.served_model
    if args.endpoint and not served:
        raise QuickdraftError(
            "--endpoint needs --served-model NAME (the model name the server expects)"
        )
    if served and not args.endpoint:
        raise QuickdraftError("--served-model is only used with --endpoint URL")
    if len(served) not in (1, len(args.endpoint)):
        raise QuickdraftError("give one --served-model for all endpoints, or one per --endpoint")
    endpoints = [(url, served[i if len(served) > 1 else 0]) for i, url in enumerate(args.endpoint)]
    if args.simulate_acceptance is not None:
        if args.temperature > 0:
            raise QuickdraftError(
                "--simulate-acceptance is only meaningful with greedy decoding (--temperature 0)"
            )
        if "none" not in methods:
            info(
                "--simulate-acceptance drafts from the plain run of each prompt: adding method 'none'"
            )
            methods.insert(0, "none")
    if not methods and not endpoints:
        raise QuickdraftError("nothing to measure: give --methods and/or --endpoint")
    return methods, endpoints


def _first_name(methods: list[str], endpoints: list[tuple[str, str]]) -> str:
    if methods:
        return methods[0]
    from urllib.parse import urlsplit

    from quickdraft.bench.runner import chat_completions_url

    url, served = endpoints[0]
    return f"{served}@{urlsplit(chat_completions_url(url)).netloc}"


def _contenders(
    args: argparse.Namespace, methods: list[str], endpoints: list[tuple[str, str]], opts: Any
) -> tuple[list[Any], Path, Any]:
    """Load the target once (or only its tokenizer when no in-process method runs) and build all;
    also returns the in-process target model (None without one)."""
    from quickdraft.bench import runner
    from quickdraft.loading.load import resolve

    contenders: list[Any] = []
    model = None
    if methods:
        from quickdraft.api import LLM

        info(f"loading {args.model} ...")
        llm = LLM(
            args.model,
            draft="none",
            dtype=args.dtype,
            max_context=args.max_context,
            kv_dtype=args.kv_dtype,
            threads=args.threads,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
        )
        info(
            f"loaded in {llm.target.load_seconds:.1f} s ({llm.target.path}), {llm.threads} threads"
        )
        contenders += runner.build_in_process(methods, args.model, llm.target, opts, info)
        tokenizer, path, model = llm.tokenizer, llm.target.path, llm.target.model
    else:
        tokenizer, path = runner.load_tokenizer(args.model), resolve(args.model)
    contenders += [
        runner.EndpointContender(url, served, tokenizer, args.api_key, args.timeout)
        for url, served in endpoints
    ]
    names = [c.name for c in contenders]
    if len(set(names)) != len(names):
        raise QuickdraftError(f"two contenders share a name: {', '.join(names)}")
    return contenders, path, model


def _meta(
    args: argparse.Namespace, model_path: Path, dataset: Any, methods: list[str], opts: Any
) -> dict[str, Any]:
    from quickdraft.bench.report import environment
    from quickdraft.bench.runner import default_draft, draft_model_for

    settings = {
        k: getattr(args, k)
        for k in (
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "ignore_eos",
            "dtype",
            "num_draft",
            "draft_vocab",
            "draft_confidence",
            "max_context",
            "kv_dtype",
            "threads",
            "device",
            "cuda_graphs",
            "simulate_acceptance",
            "prefix_cache_mb",
        )
    }
    settings.update(warmup=not args.no_warmup, interleaved=True)
    return {
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(args),
        "argv": _redact(sys.argv),
        **environment(),
        "model": {
            "spec": args.model,
            "path": str(model_path),
            "draft_model": draft_model_for(args.model, opts) if "draft" in methods else None,
            "auto_draft_model": default_draft(args.model) if "auto" in methods else None,
        },
        "dataset": {
            "name": dataset.name,
            "source": dataset.source,
            "num_prompts": len(dataset.items),
            "requests_per_method": dataset.requests_per_method,
        },
        "settings": settings,
        "wall_clock_unix": time.time(),
    }


def command_line(args: argparse.Namespace) -> str:
    """The command with every option spelled out (defaults included), the API key redacted."""
    parts = ["quickdraft", "bench"]
    for key, value in sorted(vars(args).items()):
        if key in ("func", "command") or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "api_key":
            value = "***"
        for v in value if isinstance(value, list) else [value]:
            parts += [flag] if v is True else [flag, str(v)]
    return shlex.join(parts)


def _redact(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out
