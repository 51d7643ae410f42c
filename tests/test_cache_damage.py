"""Kept files that survive damage (quickdraft/kept.py's rules): for every kind of file a start keeps
in the cache folder (prepared weights, kernel choices, pass costs, token ranks, converted weights), a garbled,
truncated, empty, wrongly shaped or foreign-version file, a temporary file left by a killed write,
a read-only cache and a full disk each cost at most one line about that kind, never a failed
start, and the start answers with the same greedy text as a clean one. A damaged file is removed
or rewritten whole; the start after it keeps everything and measures nothing.

Each start is a real one (``LLM``) of a tiny GGUF model drafting for itself with a cut draft
vocabulary, so it loads prepared weights, chooses kernels, measures pass costs and counts token
ranks; a slow test does it once with SmolLM2-135M.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from quickdraft import kept, kernels
from quickdraft.api import LLM
from quickdraft.assemble import pass_costs
from quickdraft.kernels import tuning
from quickdraft.loading import gguf as gguf_io
from quickdraft.loading import prepared
from quickdraft.quant.ggml import active_kernels
from quickdraft.sampling import SamplingParams
from quickdraft.speculative import vocab as vocab_mod

pytestmark = pytest.mark.skipif(active_kernels() is None, reason="prepared weights and kernel choices are for "
                                                                   "the native kernels")

TINY = Path(__file__).parent / "data" / "tiny-qwen2-256-Q5_K.gguf"  # (vocabulary: 300 ids)
PROMPT = "def add(a, b):"
# what makes a start-up line, a stderr line or a warning a report about a kept file
REPORT = re.compile(r"damaged|unusable|unreadable|could not keep|stale")
MEASURING = re.compile(r"measuring|choosing")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache folder, every kept kind in play (prepared weights for any GGUF, kernel
    choices for any model, one quick round), a quiet machine (conftest's machine_load); the kernel settings and thread count
    restored afterwards."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(folder))
    monkeypatch.delenv("QUICKDRAFT_PREPARED", raising=False)
    monkeypatch.delenv("QUICKDRAFT_TUNE", raising=False)
    monkeypatch.setattr(prepared, "MIN_BYTES", 0)
    monkeypatch.setattr(tuning, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(tuning, "ROUNDS", 1)
    monkeypatch.setattr(tuning, "SPREAD", float("inf"))
    monkeypatch.setattr(tuning, "recheck", lambda *_a: None)  # (a kept choice: installed as kept)
    monkeypatch.setattr(vocab_mod, "stdlib_corpus", lambda max_chars=0: ["def f(x):\n    return x + 1\n" * 30])
    mod = active_kernels()
    saved = [mod.tuning(c) for c in range(3)], kernels.isa(), torch.get_num_threads()
    yield folder
    for c, s in enumerate(saved[0]):
        mod.set_tuning(c, *s)
    kernels.set_isa(saved[1])
    torch.set_num_threads(saved[2])


@dataclass
class Start:
    """What one start said (start-up lines, stderr, warnings) and answered."""

    text: str
    said: list[str]
    stderr: list[str]
    warned: list[str]

    @property
    def reports(self) -> list[str]:
        return [line for line in [*self.said, *self.stderr, *self.warned] if REPORT.search(line)]

    @property
    def measured(self) -> list[str]:
        return [line for line in self.said if MEASURING.search(line)]


def start(capfd: pytest.CaptureFixture[str], model: Path = TINY, draft_vocab: int = 256) -> Start:
    """One start of ``model`` drafting for itself (a cut draft vocabulary: token ranks), and its
    greedy answer to PROMPT."""
    capfd.readouterr()
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(model), draft=str(model), draft_vocab=draft_vocab, max_context=128, threads=1,
                  log=said.append)
        text = llm.generate(PROMPT, SamplingParams(max_tokens=16))[0].text
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    # (ResourceWarnings: files of earlier tests the garbage collector closes during this start; a
    # start alone records none, so none is the cache code's)
    return Start(text, said, err, [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)])


# ------------------------------------------------------------------------------ the kept kinds


def only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


KINDS: dict[str, tuple[Callable[[Path], Path], str]] = {  # where its file is; what names it in a report
    "prepared": (lambda c: only([p for p in (c / "prepared").iterdir() if ".partial-" not in p.name]),
                 r"prepared weights"),
    "kernel_choices": (lambda c: c / tuning.FILE_NAME, r"kernel_choices\.json"),
    "pass_costs": (lambda c: c / pass_costs.FILE_NAME, r"pass_costs\.json"),
    "token_ranks": (lambda c: only(sorted((c / "token_ranks").glob("*.npy"))), r"token ranks"),
}


def _save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    path.write_bytes(buf.getvalue())


def damage_json(path: Path, how: str) -> None:
    raw = path.read_bytes()
    entries = json.loads(raw)
    path.write_bytes({
        "garbled": b"\x89\xfe{garbage" + raw[::-7],
        "truncated": raw[: len(raw) // 2],
        "empty": b"",
        "wrong_shape": json.dumps(list(entries.values())).encode(),  # a list, not an object
        "wrong_types": json.dumps({k: {**v, "measured": "yesterday"} for k, v in entries.items()}).encode(),
        "foreign": json.dumps({"version": 2, "entries": entries}).encode(),  # another version's layout
        "one_bad_entry": json.dumps({**entries, "another model": {"measured": None}}).encode(),
    }[how])


def damage_ranks(path: Path, how: str) -> None:
    raw = path.read_bytes()
    ranks = np.load(path)
    if how == "garbled":
        path.write_bytes(bytes(range(256)) * 4)
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "wrong_shape":
        _save_npy(path, ranks.reshape(2, -1))
    elif how == "wrong_types":
        _save_npy(path, ranks.astype(np.float32))
    elif how == "duplicates":  # the right shape and type, not an ordering of the vocabulary
        _save_npy(path, np.zeros_like(ranks))
    else:  # foreign: an .npy format version numpy does not read
        path.write_bytes(raw[:6] + bytes([9, 0]) + raw[8:])


def damage_prepared(where: Path, how: str) -> None:
    index_path = where / "index.json"
    index = json.loads(index_path.read_text())
    if how == "garbled":
        index_path.write_bytes(b"\x00garbage\xff" * 5)
    elif how == "truncated":  # a short tensor file
        with open(where / "weights.bin", "r+b") as f:
            f.truncate(os.path.getsize(where / "weights.bin") // 2)
    elif how == "empty":
        index_path.write_bytes(b"")
    elif how == "wrong_shape":
        index_path.write_text(json.dumps(list(index.values())))
    elif how == "wrong_types":
        index["tensors"][1]["offset"] = str(index["tensors"][1]["offset"])
        index_path.write_text(json.dumps(index))
    elif how == "missing":  # a missing tensor file
        (where / "weights.bin").unlink()
    elif how == "tokenizer":
        (where / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    else:  # foreign: a manifest of another format version
        index["key"]["format"] = prepared.FORMAT + 1
        index_path.write_text(json.dumps(index))


def damage(kind: str, cache: Path, how: str) -> None:
    path = KINDS[kind][0](cache)
    if kind == "prepared":
        damage_prepared(path, how)
    elif kind == "token_ranks":
        damage_ranks(path, how)
    else:
        damage_json(path, how)


def leftovers(cache: Path) -> list[Path]:
    """Temporary files and folders of writes under ``cache``."""
    return sorted(p for p in cache.rglob("*") if p.name.endswith(".tmp") or ".partial-" in p.name)


def all_kept(cache: Path, capfd: pytest.CaptureFixture[str], want: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind is kept whole: a start finds all of it (no GGUF read, nothing measured, nothing
    said about the cache) and answers ``want``."""
    for kind, (where, _) in KINDS.items():
        assert where(cache).exists(), kind
    with monkeypatch.context() as m:
        def no_gguf(*_a: object) -> None:
            raise AssertionError("the GGUF was read again: its prepared copy was not whole")

        m.setattr(gguf_io, "open_gguf", no_gguf)
        again = start(capfd)
    assert again.text == want and not again.reports and not again.measured and not again.stderr, again


# ------------------------------------------------------------------------------------- tests


def test_a_clean_cache_is_kept_and_used(cache: Path, capfd: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start keeps every kind without a word about the cache; the next one measures nothing."""
    first = start(capfd)
    assert not first.reports and not first.stderr and not first.warned, first
    assert len(first.measured) == 3  # kernels chosen; pass costs of the draft and the target
    assert not leftovers(cache)
    all_kept(cache, capfd, first.text, monkeypatch)


DAMAGES = [(kind, how) for kind in KINDS
           for how in ("garbled", "truncated", "empty", "wrong_shape", "wrong_types", "foreign")]
DAMAGES += [("prepared", "missing"), ("prepared", "tokenizer"), ("token_ranks", "duplicates"),
            ("kernel_choices", "one_bad_entry"), ("pass_costs", "one_bad_entry")]


@pytest.mark.parametrize(("kind", "how"), DAMAGES, ids=[f"{k}-{h}" for k, h in DAMAGES])
def test_a_damaged_file_is_reported_once_removed_and_rebuilt(
    cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kind: str, how: str
) -> None:
    """One line names the damaged kind; the start answers as a clean one did, keeps the kind whole
    again (the bad file removed and rebuilt, or its bad entries dropped) and warns of nothing."""
    want = start(capfd).text
    damage(kind, cache, how)
    got = start(capfd)
    assert got.text == want
    [line] = got.reports  # one line, naming the kind
    assert re.search(KINDS[kind][1], line), line
    assert not got.warned and not leftovers(cache)
    all_kept(cache, capfd, want, monkeypatch)  # rebuilt whole (or the bad entries dropped)


def test_every_kind_damaged_at_once(cache: Path, capfd: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind cut short at once: one line about each, the same answer, all kept whole again."""
    want = start(capfd).text
    for kind in KINDS:
        damage(kind, cache, "truncated")
    got = start(capfd)
    assert got.text == want
    assert len(got.reports) == len(KINDS), got.reports
    for kind, (_, name) in KINDS.items():
        assert sum(bool(re.search(name, line)) for line in got.reports) == 1, (kind, got.reports)
    all_kept(cache, capfd, want, monkeypatch)


def test_a_write_killed_before_its_rename_is_never_read_and_cleaned_up(
    cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between writing a kept file and renaming it leaves a partial temporary
    file (folder) and no kept one: the next start does not read it, keeps everything afresh and
    removes it; a temporary file as young as one being written now is left alone."""
    want = start(capfd).text
    old = time.time() - 2 * kept.TEMP_MAX_AGE_S
    planted, fresh = [], []
    for kind, (where, _) in KINDS.items():
        path = where(cache)
        if kind == "prepared":  # (a folder named by its writer's process id; none has 2**22 + 1)
            tmp = path.with_name(path.name + f".partial-{2**22 + 1}")
            path.rename(tmp)
            with open(tmp / "weights.bin", "r+b") as f:  # killed while writing the weights
                f.truncate(100)
            (tmp / "index.json").unlink()
            young = path.with_name(path.name + ".partial-1234567")  # another process, writing now
            alive = path.with_name(path.name + f".partial-{os.getppid()}")  # one whose writer still runs
            for folder in (young, alive):
                folder.mkdir()
                (folder / "weights.bin").write_bytes(b"\0" * 64)
            for p in [*tmp.iterdir(), tmp, *alive.iterdir(), alive]:
                os.utime(p, (old, old))
            fresh += [young, alive]
            planted.append(tmp)
            continue
        raw = path.read_bytes()
        path.unlink()
        tmp = path.with_name(f".{path.name}.k1ll3d.tmp")
        tmp.write_bytes(raw[: len(raw) // 2])
        os.utime(tmp, (old, old))
        planted.append(tmp)
        young = path.with_name(f".{path.name}.wr1t1ng.tmp")
        young.write_bytes(raw[:10])
        fresh.append(young)
    legacy = cache / ".pass_costs.x7y8z9w0"  # (what an earlier version named its temporary files)
    legacy.write_text("{")
    os.utime(legacy, (old, old))
    planted.append(legacy)

    got = start(capfd)
    assert got.text == want and not got.reports and not got.stderr, got  # never read as the real file
    assert not any(p.exists() for p in planted)
    assert all(p.exists() for p in fresh)
    all_kept(cache, capfd, want, monkeypatch)


def read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make every write under ``folder`` fail as on a read-only file system (tests run as root,
    where a chmod does not stop writes): creating, opening for writing, renaming, removing or
    touching anything there raises PermissionError; reading works."""
    root = os.path.abspath(folder)

    def inside(p: Any) -> bool:
        try:
            return os.path.abspath(os.fspath(p)).startswith(root)
        except TypeError:  # (a file descriptor)
            return False

    def deny(p: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied (a read-only cache)", os.fspath(p))

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def guarded_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if inside(file) and any(c in mode for c in "wax+"):
            deny(file)
        return real_open(file, mode, *a, **k)

    def guarded_os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            deny(path)
        return real_os_open(path, flags, *a, **k)

    def guarded_mkdir(path: Any, *a: Any, **k: Any) -> None:
        if inside(path):
            if os.path.exists(path):
                raise FileExistsError(errno.EEXIST, "File exists", os.fspath(path))
            deny(path)
        real_mkdir(path, *a, **k)

    def guard(real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(path: Any, *a: Any, **k: Any) -> Any:
            if inside(path) or "dir_fd" in k:  # (shutil.rmtree's removals go by dir_fd)
                deny(path)
            return real(path, *a, **k)
        return guarded

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    for name in ("unlink", "remove", "rmdir", "replace", "rename", "utime"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))


def test_a_read_only_cache_starts_without_keeping(cache: Path, capfd: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing can be kept: one warning per kind, the same answer; a read-only cache that holds
    everything already is used as it is (no warning, nothing measured)."""
    want = start(capfd).text
    empty = cache.parent / "empty"
    empty.mkdir()
    with monkeypatch.context() as m:
        m.setenv("QUICKDRAFT_CACHE", str(empty))
        read_only(m, empty)
        got = start(capfd)
    assert got.text == want and not list(empty.iterdir())
    one_warning_per_kind(got, "Permission denied")
    with monkeypatch.context() as m:
        read_only(m, cache)
        used = start(capfd)
    assert used.text == want and not used.reports and not used.measured and not used.stderr, used
    if os.geteuid() != 0:  # where permissions stop this user's writes, a really read-only folder too
        real = cache.parent / "read-only"
        real.mkdir(mode=0o555)
        try:
            with monkeypatch.context() as m:
                m.setenv("QUICKDRAFT_CACHE", str(real))
                got = start(capfd)
            assert got.text == want and not list(real.iterdir())
            one_warning_per_kind(got, "Permission denied")
        finally:
            real.chmod(0o755)


def one_warning_per_kind(got: Start, cause: str) -> None:
    """``got`` warned once about each kind it could not keep, saying ``cause``, and reported nothing else."""
    assert len(got.warned) == len(KINDS) and got.reports == got.warned and not got.stderr, got
    assert all("could not keep" in w and cause in w for w in got.warned), got.warned
    for kind, (_, name) in KINDS.items():
        assert sum(bool(re.search(name, w)) for w in got.warned) == 1, (kind, got.warned)


def test_a_full_disk_starts_without_keeping(cache: Path, capfd: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kept write fails with ENOSPC (as the flush to disk before the rename reports it): one
    warning per kind, no temporary file left, the same answer; the next start keeps everything."""
    want = start(capfd).text
    full = cache.parent / "full"
    full.mkdir()
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(full))

    def no_space(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", no_space)
        got = start(capfd)
    assert got.text == want
    one_warning_per_kind(got, "No space left on device")
    assert not leftovers(full) and not [p for p in full.rglob("*") if p.is_file()]
    assert start(capfd).text == want  # (room again: kept)
    all_kept(full, capfd, want, monkeypatch)


@pytest.mark.slow
def test_real_model_damaged_cache_answers_the_same(cache: Path, capfd: pytest.CaptureFixture[str],
                                                   smollm2_gguf: Path) -> None:
    """SmolLM2-135M: every kind kept, then garbled, then read-only: the same greedy text each time."""
    clean = start(capfd, smollm2_gguf, draft_vocab=4096)
    assert not clean.reports, clean
    for kind in KINDS:
        damage(kind, cache, "garbled")
    damaged = start(capfd, smollm2_gguf, draft_vocab=4096)
    assert damaged.text == clean.text and len(damaged.reports) == len(KINDS), damaged.reports
    again = start(capfd, smollm2_gguf, draft_vocab=4096)
    assert again.text == clean.text and not again.reports and not again.measured, again


# ------------------------------------------------- converted weights (--dtype float32 of a zoo GGUF)


def float_start(capfd: pytest.CaptureFixture[str], model: Path) -> Start:
    """A start of ``model`` on the torch path (``dtype="float32"``: the GGUF dequantized, which a
    zoo model keeps under converted/), and its greedy answer to PROMPT."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(model), dtype="float32", max_context=128, threads=1)
        text = llm.generate(PROMPT, SamplingParams(max_tokens=8))[0].text
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    return Start(text, [], err, [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)])


@pytest.mark.parametrize("how", ["garbled", "truncated", "empty", "foreign", "killed"])
def test_damaged_converted_weights_are_reported_removed_and_converted_again(
    cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A zoo model's converted copy cut short, garbled, empty, of a foreign config, or a write killed
    before its rename: one line (none for the killed write, which is never read), the same answer,
    the copy kept whole again and used by the next start (no GGUF tensors read)."""
    (cache / "models").mkdir()
    model = cache / "models" / TINY.name
    model.write_bytes(TINY.read_bytes())
    want = float_start(capfd, model)
    assert not want.reports and not want.warned, want
    [copy] = (cache / "converted").iterdir()
    raw = copy.read_bytes()
    if how == "garbled":
        copy.write_bytes(b"\xff" * 64 + raw[64:])
    elif how == "truncated":
        copy.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        copy.write_bytes(b"")
    elif how == "foreign":  # a header whose config another version wrote
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        header["__metadata__"]["quickdraft.config"] = json.dumps({"layout": "of another version"})
        new = json.dumps(header).encode().ljust(header_len)
        assert len(new) == header_len
        copy.write_bytes(raw[:8] + new + raw[8 + header_len:])
    else:  # killed between write and rename: a whole-looking temporary file, and no copy
        stale = copy.with_name(f".{copy.stem}.partial-1.tmp")
        copy.rename(stale)
        os.utime(stale, (time.time() - 2 * kept.TEMP_MAX_AGE_S,) * 2)
    got = float_start(capfd, model)
    assert got.text == want.text and not got.warned
    if how == "killed":
        assert not got.reports and not leftovers(cache)
    else:
        [line] = got.reports
        assert line.startswith("converted weights") and "removed it" in line, line
    with monkeypatch.context() as m:
        m.setattr(gguf_io, "iter_tensors", lambda *_a, **_k: pytest.fail("the GGUF was converted again"))
        again = float_start(capfd, model)
    assert again.text == want.text and not again.reports and not again.warned
