"""The whole ``quickdraft train-eagle3`` run: data -> capture -> vocabulary -> training -> head files.

Everything a run produces lives in its output folder, so an interrupted run continues with
``resume=True`` where it stopped:

    run.json              the options that define the run (a resume must repeat them)
    sequences.jsonl       the training sequences; regenerated.jsonl: answers the target wrote
    features/             captured target features (shards + manifest.json)
    checkpoint/state.pt   head + optimizer + step + data position
    config.json, model.safetensors   the finished head (Hugging Face EAGLE-3 layout, bf16)
    train_log.json        data, tokens seen, wall time per stage, accuracies, loss history
    stage_seconds.json    wall time per stage, summed over the invocations of a resumed run

``device`` (cpu, cuda[:N], auto) says where the target captures and the head trains; it is not
part of the run's identity, so a run captured on one device may be resumed on another.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quickdraft.config import resolve_device
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.speculative.eagle3.head import Eagle3Config, default_aux_layers
from quickdraft.speculative.eagle3.io import load_head, save_head
from quickdraft.train import data as data_mod
from quickdraft.train.capture import FeatureSet, capture_features, check_aux_layers
from quickdraft.train.eagle3 import (
    TrainConfig,
    Trainer,
    chain_tau,
    dense_weight,
    export_head,
    init_head,
    write_json,
)
from quickdraft.train.vocab import build_vocab, coverage, special_ids, token_counts

RUN_FILE = "run.json"
HEAD_FILES = ("config.json", "model.safetensors")


@dataclass(frozen=True)
class RunOptions:
    target: str
    out: Path
    data: str = "stdlib,sharegpt,alpaca"
    max_tokens: int = 200_000
    seq_len: int = 512
    regenerate: int = 0
    regen_max_tokens: int = 384
    topk: int = 8
    aux_layers: tuple[int, ...] | None = None  # INPUT-of-layer ids; None = (2, L//2, L-3)
    draft_vocab: int = 8192
    intermediate_size: int | None = None  # None = the target's
    dtype: str = "float32"  # the target's dtype for capture and regeneration
    device: str = "auto"  # capture, head, batches and optimizer: auto = cuda if available, else cpu
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: bool = False

    def identity(self) -> dict[str, Any]:
        """What a resumed run must repeat: what defines the data, the features and the head's
        shape (training settings are checked by the checkpoint, so they may still change until
        training has started)."""
        d = asdict(self)
        for key in ("resume", "out", "train", "device"):  # a run may continue on another device
            d.pop(key)
        d["aux_layers"] = None if self.aux_layers is None else list(self.aux_layers)
        d["seed"] = self.train.seed  # also orders the data
        return d


@dataclass
class RunReport:
    out: Path
    head_bytes: int
    summary: dict[str, Any]


def check_out(opts: RunOptions) -> None:
    """Refuse a folder that is not this run's; on resume, check the options match (no writes)."""
    out, run_file = opts.out, opts.out / RUN_FILE
    if opts.resume:
        if not run_file.is_file():
            raise QuickdraftError(f"nothing to resume in {out} (no {RUN_FILE}); start the run without --resume")
        old = json.loads(run_file.read_text())
        new = json.loads(json.dumps(opts.identity()))
        if old != new:
            changed = sorted(_diff(old, new))
            raise QuickdraftError(
                f"{out} holds a run with other options ({', '.join(changed)}); repeat the original options "
                "with --resume, or choose another --out"
            )
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        hint = "continue it with --resume" if run_file.is_file() else "choose another --out"
        raise QuickdraftError(f"{out} already exists and is not empty; {hint}")


def start_out(opts: RunOptions) -> None:
    opts.out.mkdir(parents=True, exist_ok=True)
    if not opts.resume:
        write_json(opts.out / RUN_FILE, opts.identity())


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = set(old) | set(new)
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def regenerate_fn(loaded: LoadedModel) -> data_mod.Generate:
    """Greedy answers by the target through quickdraft's engine (n-gram drafting: same tokens,
    fewer target passes)."""
    from quickdraft.engine import Engine
    from quickdraft.sampling import SamplingParams
    from quickdraft.speculative.ngram import NGramDrafter

    engine = Engine(loaded.model, loaded.tokenizer)

    def generate(prompt: list[int], max_new: int) -> list[int]:
        out: list[int] = []
        for step in engine.generate(prompt, SamplingParams(max_tokens=max_new), NGramDrafter(), num_draft=4):
            out += step.token_ids
        return out

    return generate


def run(opts: RunOptions, log: Callable[[str], None] = lambda _m: None, progress: bool = True) -> RunReport:
    """Run (or resume) every stage and write the head; returns where and what was written. Kept
    whole, over 60 lines: its five numbered stages read in order and share the run's paths, the
    target and the stage timings (saved after each stage)."""
    sources = data_mod.parse_sources(opts.data)  # refuse bad data before loading anything
    if opts.regenerate < 0:
        raise QuickdraftError(f"--regenerate must be >= 0, got {opts.regenerate}")
    device = resolve_device(opts.device)
    check_out(opts)
    t_start = time.perf_counter()
    log(f"loading target {opts.target} ({opts.dtype}, {device}) ...")
    loaded = load_model(opts.target, dtype=opts.dtype, device=str(device), max_context=opts.seq_len)
    model, tcfg = loaded.model, loaded.config
    default = tuple(sorted(set(default_aux_layers(tcfg.num_hidden_layers))))  # shallow models repeat ids
    aux = check_aux_layers(opts.aux_layers or default, tcfg.num_hidden_layers)
    head_cfg = Eagle3Config.for_target(tcfg, aux, min(opts.draft_vocab, tcfg.vocab_size), opts.intermediate_size)
    if opts.draft_vocab > tcfg.vocab_size:
        log(f"--draft-vocab {opts.draft_vocab} exceeds the target's vocabulary; using {tcfg.vocab_size}")
    start_out(opts)
    times = _load_times(opts.out)
    total0 = times["total"]

    def save_times() -> None:  # after each stage, so an interrupted run keeps what it spent
        times["total"] = total0 + time.perf_counter() - t_start
        _save_times(opts.out, times)

    # 1. data
    t0 = time.perf_counter()
    seq_file = opts.out / "sequences.jsonl"
    if seq_file.is_file():
        records = data_mod.load_sequences(seq_file)
        log(f"data: {len(records)} sequences from {seq_file}")
    else:
        log(f"data: {opts.max_tokens} tokens from {', '.join(sources)}"
            + (f", the target answering {opts.regenerate} prompts" if opts.regenerate else ""))
        records = data_mod.build_sequences(
            loaded.tokenizer, sources, opts.max_tokens, opts.seq_len, seed=opts.train.seed,
            regenerate=opts.regenerate, generate=regenerate_fn(loaded) if opts.regenerate else None,
            regen_cache=opts.out / "regenerated.jsonl", regen_max_new=opts.regen_max_tokens, progress=progress,
        )
        data_mod.save_sequences(seq_file, records)
    times["data"] += time.perf_counter() - t0
    save_times()

    # 2. capture
    t0 = time.perf_counter()
    features = capture_features(model, [r.tokens for r in records], opts.out / "features", aux, opts.topk,
                                progress=progress)
    times["capture"] += time.perf_counter() - t0
    save_times()
    log(f"features: {features.num_tokens} tokens in {len(features)} sequences, aux layers {list(aux)} (inputs)")

    # 3. draft vocabulary
    counts = token_counts(tcfg.vocab_size, features.labels(), features.tokens())
    d2t, t2d = build_vocab(counts, head_cfg.draft_vocab_size, special_ids(loaded.tokenizer))
    label_cover = coverage(token_counts(tcfg.vocab_size, features.labels()), t2d)
    log(f"draft vocabulary: {head_cfg.draft_vocab_size} tokens cover {label_cover:.1%} of the target's predictions")

    # 4. training
    head = init_head(head_cfg, model, d2t, seed=opts.train.seed, max_len=opts.seq_len + opts.train.ttt_steps + 1)
    head.to(device)  # initialised on the CPU (same seed, same weights on every device)
    embed = dense_weight(model.model.embed_tokens)
    trainer = Trainer(head, features, embed, opts.train, opts.out / "checkpoint", log, progress)
    if opts.resume and trainer.load_checkpoint():
        log(f"resuming training at step {trainer.state.step} of {trainer.total_steps}")
    result = trainer.run()
    times["train"] = result.state.wall_seconds
    log(f"trained {result.state.step} steps on {result.state.tokens_seen} tokens in {result.state.wall_seconds:.0f} s")

    # 5. the head
    save_head(export_head(head), opts.out)
    _check_written(opts.out, model, head_cfg)
    head_bytes = sum((opts.out / f).stat().st_size for f in HEAD_FILES)
    save_times()
    summary = _summary(opts, records, features, result, label_cover, head_bytes, times, t2d.sum())
    write_json(opts.out / "train_log.json", summary)
    return RunReport(opts.out, head_bytes, summary)


def _check_written(out: Path, model: CausalLM, cfg: Eagle3Config) -> None:
    head, _info = load_head(out, model)
    if head.config.aux_layers != cfg.aux_layers or head.config.draft_vocab_size != cfg.draft_vocab_size:
        raise QuickdraftError(f"the head written to {out} does not read back as written")


_STAGES = ("data", "capture", "train", "total")


def _load_times(out: Path) -> dict[str, float]:
    path = out / "stage_seconds.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    return {k: float(old.get(k, 0.0)) for k in _STAGES}


def _save_times(out: Path, times: dict[str, float]) -> None:
    write_json(out / "stage_seconds.json", {k: round(v, 1) for k, v in times.items()})


def _summary(
    opts: RunOptions,
    records: list[data_mod.SeqRecord],
    features: FeatureSet,
    result: Any,
    label_cover: float,
    head_bytes: int,
    times: dict[str, float],
    draft_vocab: torch.Tensor,
) -> dict[str, Any]:
    by_source: Counter[str] = Counter()
    seqs: Counter[str] = Counter()
    for r in records:
        by_source[r.source] += len(r.tokens)
        seqs[r.source] += 1
    ev = result.eval
    eval_acc = ev.accuracy() if ev is not None else None
    return {
        "options": {**opts.identity(), "train": asdict(opts.train)},
        "data": {
            "tokens": sum(by_source.values()),
            "sequences": len(records),
            "tokens_by_source": dict(by_source),
            "sequences_by_source": dict(seqs),
            "regenerated_sequences": sum(r.regenerated for r in records),
            "regenerated_tokens": sum(len(r.tokens) for r in records if r.regenerated),
        },
        "capture": {"aux_layers": list(features.aux_layers), "aux_layer_convention": "input",
                    "tokens": features.num_tokens, "topk": features.topk},
        "draft_vocab": {"size": int(draft_vocab), "label_coverage": round(label_cover, 4)},
        "training": {
            "steps": result.state.step,
            "total_steps": result.total_steps,
            "epochs_done": round(result.state.step / max(1, result.total_steps) * opts.train.epochs, 3),
            "tokens_seen": result.state.tokens_seen,
            "train_accuracy_per_step": [round(a, 4) for a in result.train_accuracy],
            "eval_sequences": result.eval_sequences,
            "eval_loss": None if ev is None else round(ev.loss, 4),
            "eval_accuracy_per_step": None if eval_acc is None else [round(a, 4) for a in eval_acc],
            "eval_chain_tau_estimate": None if eval_acc is None else round(chain_tau(eval_acc), 3),
        },
        "head_bytes": head_bytes,
        "wall_seconds": {k: round(v, 1) for k, v in times.items()},
        "history": result.state.history,
    }
