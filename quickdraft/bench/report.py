"""Benchmark output: a terminal table, ``bench.json`` (everything), ``bench.md`` and ``bench.png``."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from quickdraft import __version__
from quickdraft.bench.metrics import Record, describe_decisions, summarize_method
from quickdraft.hardware import cpu_model

SCHEMA = "quickdraft.bench/1"


def environment() -> dict[str, Any]:
    """Versions and hardware, so a result can be compared with another machine's."""
    from quickdraft.quant.ggml import active_kernels

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    kernels = active_kernels()
    return {
        "versions": {
            "quickdraft": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "hardware": {
            "cpu": cpu_model(),
            "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(logical=True),
            "torch_threads": torch.get_num_threads(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": gpu,
            # the native CPU kernels' q8 GEMM build (avx2 / avx512vnni); None: torch reference path
            "cpu_kernels_isa": kernels.isa() if kernels is not None else None,
        },
    }


def build_report(
    meta: dict[str, Any],
    methods: Sequence[dict[str, Any]],
    records: Sequence[Record],
    baseline: str,
) -> dict[str, Any]:
    """The whole result as one JSON-ready dict: metadata, per-method summaries, every record."""
    names = [m["name"] for m in methods]
    summary = {n: summarize_method([r for r in records if r.method == n]) for n in names}
    return {
        "schema": SCHEMA,
        **meta,
        "baseline": baseline,
        "methods": list(methods),
        "summary": summary,
        "records": [r.to_dict() for r in records],
    }


def write_outputs(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "bench.json",
        "md": out_dir / "bench.md",
        "png": out_dir / "bench.png",
    }
    _atomic_write(paths["json"], json.dumps(report, indent=2, allow_nan=False) + "\n")
    _atomic_write(paths["md"], markdown(report, png_name=paths["png"].name))
    plot(report, paths["png"])
    if plot_ttft_by_turn(report, out_dir / "ttft_by_turn.png"):
        paths["ttft_png"] = out_dir / "ttft_by_turn.png"
    return paths


def plot_ttft_by_turn(report: dict[str, Any], path: Path) -> bool:
    """Median TTFT per turn, one line per method (log scale); False when there is one turn."""
    from matplotlib.figure import Figure

    series = {n: s.get("by_turn", []) for n, s in report["summary"].items()}
    if max((len(v) for v in series.values()), default=0) < 2:
        return False
    fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    ax = fig.subplots()
    for i, (name, turns) in enumerate(series.items()):
        pts = [(t["turn"] + 1, t["ttft"]["median"]) for t in turns if t["ttft"]["median"] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i % 10}", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, s (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(f"{report['model']['spec']} on {report['dataset']['name']}: TTFT per turn", fontsize=10)
    fig.savefig(path, format="png")
    return True


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Formatting helpers


def _f(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per method: the numbers the terminal table and the Markdown share."""
    rows = []
    for name, s in report["summary"].items():
        tps, sp = s["tokens_per_second"], s["speedup"]
        drafted = "-" if s["drafted"] is None else f"{s['accepted']}/{s['drafted']}"
        rows.append(
            [
                name,
                _f(tps["median"]),
                f"{_f(tps['p10'])}-{_f(tps['p90'])}",
                "-" if name == report["baseline"] else _f(sp["median"], 2, "x"),
                _f(s["ttft"]["median"], 3),
                _f(s["e2e"]["median"], 2),
                _f(s["tau_pooled"], 2),
                _pct(s["acceptance_rate"]),
                drafted,
                _f(s["peak_rss_mb"], 0),
                s["same_as_baseline"] or "-",
            ]
        )
    return rows


SUMMARY_HEADER = [
    "method",
    "tok/s median",
    "tok/s p10-p90",
    "speedup",
    "TTFT s",
    "E2E s",
    "tau",
    "accept",
    "accepted/drafted",
    "peak RSS MB",
    "same output",
]
_SHORT_HEADER = [
    "method",
    "tok/s",
    "p10-p90",
    "speedup",
    "TTFT s",
    "E2E s",
    "tau",
    "accept",
    "acc/drafted",
    "RSS MB",
    "same",
]


def print_table(report: dict[str, Any]) -> None:
    """The summary on stdout (rich table)."""
    from rich.console import Console
    from rich.table import Table

    s = report["settings"]
    table = Table(
        title=f"{report['model']['spec']} on {report['dataset']['name']}: "
        f"{report['dataset']['num_prompts']} prompts, max {s['max_tokens']} tokens, "
        f"temperature {s['temperature']}; speedup over {report['baseline']} (per-prompt median)"
    )
    for i, col in enumerate(_SHORT_HEADER):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for row in summary_rows(report):
        table.add_row(*row)
    console = Console(file=sys.stdout)
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(file=sys.stdout, width=160)
    console.print(table)
    for name, summary in report["summary"].items():
        if summary.get("decisions"):
            console.print(f"cost model, {name}: {describe_decisions(summary['decisions'])}")


def markdown(report: dict[str, Any], png_name: str = "bench.png") -> str:
    s, hw, v, ds = report["settings"], report["hardware"], report["versions"], report["dataset"]
    lines = [
        f"# quickdraft bench: {report['model']['spec']} on {ds['name']}",
        "",
        f"`{report['command']}`",
        "",
        f"- {report['created']}; quickdraft {v['quickdraft']}, torch {v['torch']}, Python {v['python']}",
        f"- {hw['cpu']}, {hw['physical_cores']} cores ({hw['logical_cores']} logical), "
        f"{hw['torch_threads']} threads, {hw['memory_gb']} GB"
        + (f", GPU {hw['gpu']}" if hw["gpu"] else ""),
        f"- model `{report['model']['path']}`, dtype {s['dtype']}; dataset {ds['source']}: "
        f"{ds['num_prompts']} prompts, {ds['requests_per_method']} requests per method",
        f"- max {s['max_tokens']} tokens, temperature {s['temperature']}, seed {s['seed']} + prompt index, "
        f"num-draft {s['num_draft']}"
        + (
            f", simulated tau {s['simulate_acceptance']}"
            if s["simulate_acceptance"] is not None
            else ""
        ),
        "- one warm-up request per method first (not recorded); methods interleaved prompt by prompt",
        "- tok/s = output tokens after the first / time after the first token; speedup = per-prompt "
        f"tok/s over {report['baseline']}, median; tau = tokens per target pass, pooled over all passes",
        "- peak RSS is this process's (all in-process methods share it; endpoints: not measured)",
        "",
        "## Summary",
        "",
        *_md_table(SUMMARY_HEADER, summary_rows(report)),
        "",
        *([f"- {report['roofline']['line']}", ""] if report.get("roofline") else []),
        *[f"- cost model, {name}: {describe_decisions(m['decisions'])}"
          for name, m in report["summary"].items() if m.get("decisions")],
        "",
        *_md_by_turn(report),
        "## Acceptance by draft position",
        "",
        *_md_acceptance(report),
        "",
        f"![tokens/s and acceptance]({png_name})",
        "",
        "## Per prompt",
        "",
        *_md_records(report),
        "",
    ]
    return "\n".join(lines)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def _md_by_turn(report: dict[str, Any]) -> list[str]:
    """Per turn and method: median TTFT, cached prompt tokens, tok/s (multi-turn datasets only)."""
    rows = []
    for name, s in report["summary"].items():
        for t in s.get("by_turn", []):
            rows.append([str(t["turn"] + 1), name, _f(t["prompt_tokens"]["median"], 0),
                         _f(t["cached_tokens"]["median"], 0), _f(t["ttft"]["median"], 3),
                         _f(t["tokens_per_second"]["median"]), _f(t["tau"]["median"], 2)])
    if len({r[0] for r in rows}) < 2:
        return []
    rows.sort(key=lambda r: int(r[0]))
    header = ["turn", "method", "prompt tokens", "cached", "TTFT s", "tok/s", "tau"]
    return ["## By turn (medians)", "", *_md_table(header, rows), "",
            "![TTFT per turn](ttft_by_turn.png)", ""]


def _md_acceptance(report: dict[str, Any]) -> list[str]:
    rates = {
        n: s["acceptance_by_position"]
        for n, s in report["summary"].items()
        if s["acceptance_by_position"]
    }
    if not rates:
        return ["(no method drafted any tokens)"]
    width = max(len(r) for r in rates.values())
    rows = [
        [n, *[_pct(r[i]) if i < len(r) else "-" for i in range(width)]] for n, r in rates.items()
    ]
    return _md_table(["method", *[str(i + 1) for i in range(width)]], rows)


def _md_records(report: dict[str, Any]) -> list[str]:
    header = [
        "prompt",
        "turn",
        "method",
        "tokens",
        "tok/s",
        "TTFT s",
        "E2E s",
        "tau",
        "speedup",
        "cached",
        "finish",
    ]
    rows = [
        [
            r["item_id"],
            str(r["turn"] + 1),
            r["method"],
            str(r["output_tokens"]),
            _f(r["tokens_per_second"]),
            _f(r["ttft"], 3),
            _f(r["e2e"], 2),
            _f(r["tau"], 2),
            _f(r["speedup"], 2, "x"),
            "-" if r.get("cached_tokens") is None else f"{r['cached_tokens']}/{r['prompt_tokens']}",
            r["finish_reason"] or "-",
        ]
        for r in report["records"]
    ]
    return _md_table(header, rows)


# --------------------------------------------------------------------------------------------
# Plot


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: tokens/s per method (median bar, p10-p90 whisker, each request a dot), and the
    acceptance rate at each draft position per method. Agg canvas, no pyplot global state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.2), dpi=110, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1.15, 1])
    names = list(report["summary"])
    colors = [f"C{i % 10}" for i in range(len(names))]
    _plot_speed(left, report, names, colors)
    _plot_acceptance(right, report, names, colors)
    s, hw = report["settings"], report["hardware"]
    fig.suptitle(
        f"{report['model']['spec']} on {report['dataset']['name']} "
        f"({report['dataset']['num_prompts']} prompts, max {s['max_tokens']} tokens, "
        f"T={s['temperature']}) - {hw['cpu']}, {hw['torch_threads']} threads",
        fontsize=11,
    )
    fig.savefig(path, format="png")


def _plot_speed(ax: Any, report: dict[str, Any], names: list[str], colors: list[str]) -> None:
    for i, (name, color) in enumerate(zip(names, colors, strict=True)):
        tps = report["summary"][name]["tokens_per_second"]
        if tps["median"] is None:
            continue
        med, lo, hi = tps["median"], tps["p10"], tps["p90"]
        ax.bar(i, med, color=color, alpha=0.55, width=0.6)
        ax.errorbar(i, med, yerr=[[med - lo], [hi - med]], color="black", capsize=6, lw=1.5)
        pts = [
            r["tokens_per_second"]
            for r in report["records"]
            if r["method"] == name and r["tokens_per_second"] is not None
        ]
        xs = [i - 0.18 + 0.36 * (j + 0.5) / len(pts) for j in range(len(pts))]
        ax.scatter(xs, pts, s=12, color="black", alpha=0.6, zorder=3)
        sp = report["summary"][name]["speedup"]["median"]
        label = f"{med:.1f}" + (
            f"\n{sp:.2f}x" if sp is not None and name != report["baseline"] else ""
        )
        ax.annotate(
            label,
            (i, max([hi, *pts])),
            textcoords="offset points",
            xytext=(0, 5),
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xticks(range(len(names)), names, rotation=15 if len(names) > 4 else 0)
    ax.set_ylabel("output tokens/s per user")
    ax.set_title(
        f"Output speed: median, p10-p90, each request (speedup over {report['baseline']})",
        fontsize=10,
    )
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.grid(axis="y", alpha=0.3)


def _plot_acceptance(ax: Any, report: dict[str, Any], names: list[str], colors: list[str]) -> None:
    drew = False
    for name, color in zip(names, colors, strict=True):
        rates = report["summary"][name]["acceptance_by_position"]
        if not rates:
            continue
        pos = list(range(1, len(rates) + 1))
        tau = report["summary"][name]["tau_pooled"]
        counts = report["summary"][name]["drafted_by_position"]
        sizes = [12 + 100 * (c / max(counts)) ** 0.5 for c in counts]  # area ~ how many drafts
        ax.plot(pos, rates, color=color, label=f"{name} (tau {tau:.2f})" if tau else name)
        ax.scatter(pos, rates, s=sizes, color=color, zorder=3)
        drew = True
    ax.set_title(
        "Acceptance rate by draft position (dot area ~ drafts at that position)", fontsize=10
    )
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at that position")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if drew:
        ax.legend(fontsize=9)
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(
            0.5,
            0.5,
            "no method drafted any tokens",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
