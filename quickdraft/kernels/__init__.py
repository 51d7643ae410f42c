"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

``load()`` builds ``ggml_cpu.cpp`` (+ ``ggml_cpu.h``) once per source version into torch's
extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and returns
the module, or ``None`` (with one warning) where it cannot: not x86-64, a CPU without
AVX2/FMA/F16C, no compiler or ninja, or any build error. Callers then use the pure-PyTorch
reference path (``quickdraft.quant``), so the package installs and runs everywhere.

The q8 GEMM is built twice, for AVX2 and for AVX-512 VNNI (``ggml_q8_avx512.cpp``); the module
runs the best build this CPU supports (``isa()``), with bitwise-equal results.
``QUICKDRAFT_ISA=avx2`` (or ``set_isa``) forces the AVX2 build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

_DIR = Path(__file__).parent
SOURCES = [_DIR / "ggml_cpu.cpp", _DIR / "ggml_q8_avx512.cpp", _DIR / "ops_cpu.cpp", _DIR / "decode_cpu.cpp",
           _DIR / "delta_cpu.cpp", _DIR / "delta_avx512.cpp"]
HEADERS = [_DIR / "ggml_cpu.h", _DIR / "ggml_q8.h", _DIR / "ops_api.h", _DIR / "simd_exp.h", _DIR / "delta_head.h"]
# AVX2/FMA/F16C only (no -march=native): the build must run on any x86-64 machine with those.
# -ffp-contract=off: no silent a*b+c fusing; every fused multiply-add in the kernels is explicit.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
_error: str | None = None


def _cpu_unsupported() -> str | None:
    """None if this CPU can run the kernels, else the reason it cannot."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU architecture {platform.machine()} is not x86-64"
    try:
        import torch

        cap = torch.backends.cpu.get_cpu_capability()
        if cap not in ("AVX2", "AVX512"):
            return f"torch reports CPU capability {cap}; the kernels need AVX2"
    except Exception:  # older torch without get_cpu_capability: /proc/cpuinfo decides
        pass
    try:
        flags: set[str] = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return None  # not Linux: torch's capability check above is all there is
    missing = [f for f in ("avx2", "fma", "f16c") if flags and f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def _ensure_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH: put the pip ``ninja`` package's first, so every process
    builds with the same one (two ninja versions, e.g. a system 1.11 and pip's 1.13, discard each
    other's build logs and rebuild everything, ~80 s, whenever they alternate)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, "ninja")):
            path = os.environ.get("PATH", "")
            if not path.startswith(d + os.pathsep):
                os.environ["PATH"] = d + os.pathsep + path
            return


def build_name() -> str:
    """Extension name: one per source and flag version, so an edit never loads a stale build."""
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(_torch_version().encode())  # the module links against this torch
    return f"quickdraft_ggml_cpu_{h.hexdigest()[:12]}"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _build() -> ModuleType:
    import torch.utils.cpp_extension as ext

    _ensure_ninja_on_path()
    name = build_name()
    build_dir = Path(ext._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    if built.is_file() and not (build_dir / "lock").exists():
        # The name hashes every source, flag and the torch version: an existing build is this
        # one, so import it directly instead of asking ninja whether it is up to date.
        try:
            return _import_built(name, built)
        except ImportError:  # damaged (e.g. a build killed mid-link): build again below
            pass
    else:
        print("building quickdraft CPU kernels (once) ...", file=sys.stderr, flush=True)
    return ext.load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(_DIR)],
        build_directory=str(build_dir),
        verbose=False,
    )


def _import_built(name: str, path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def load() -> ModuleType | None:
    """The compiled kernel module, built on first call; None (warned once) if it cannot be."""
    global _module, _tried, _error
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        reason = _cpu_unsupported()
        if reason is None:
            requested = env_isa()  # a bad value stops here, saying what to set
            try:
                _module = _build()
            except Exception as exc:  # compiler, ninja, headers, linker: any failure means fallback
                lines = str(exc).strip().splitlines()
                reason = f"{type(exc).__name__}: {lines[-1] if lines else exc!r}"
            if _module is not None and requested is not None:
                try:
                    _module.set_isa(requested)
                except RuntimeError as exc:  # e.g. avx512vnni asked for on a CPU without it
                    warnings.warn(
                        f"QUICKDRAFT_ISA ignored: {str(exc).splitlines()[0]}", RuntimeWarning, stacklevel=2
                    )
        if reason is not None:
            _error = reason
            warnings.warn(
                f"quickdraft CPU kernels unavailable ({reason}); using the slower pure-PyTorch path",
                RuntimeWarning,
                stacklevel=2,
            )
        _tried = True
        return _module


def env_isa() -> str | None:
    """The q8 GEMM build QUICKDRAFT_ISA asks for (None: unset = the best this CPU runs)."""
    value = os.environ.get("QUICKDRAFT_ISA", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("avx2", "avx512vnni"):
        return value
    from quickdraft.errors import QuickdraftError

    raise QuickdraftError(
        f"QUICKDRAFT_ISA={value!r} is not an instruction set of the kernels; set it to auto (the "
        "default: the best this CPU runs), avx2 or avx512vnni"
    )


def set_isa(name: str) -> str:
    """Select the q8 GEMM build ('auto', 'avx2', 'avx512vnni'); returns the previous one."""
    module = load()
    if module is None:
        raise RuntimeError(f"quickdraft CPU kernels unavailable: {_error}")
    return str(module.set_isa(name))


def cpu_runs(name: str) -> bool:
    """True if this CPU runs the q8 GEMM build ``name`` ('avx2', 'avx512vnni')."""
    module = load()
    if module is None:
        return False
    prev = str(module.isa())
    try:
        module.set_isa(name)
        return True
    except RuntimeError:
        return False
    finally:
        module.set_isa(prev)


def isa() -> str | None:
    """The instruction set of the q8 GEMM in use ('avx2' or 'avx512vnni'); None without kernels."""
    module = load()
    return None if module is None else str(module.isa())


def load_error() -> str | None:
    """Why ``load()`` returned None (after it was called), else None."""
    return _error


def disabled_by_env() -> bool:
    """True when ``QUICKDRAFT_KERNELS=ref`` (or reference/off/0/none) asks for the reference path."""
    return os.environ.get("QUICKDRAFT_KERNELS", "").strip().lower() in (
        "ref",
        "reference",
        "off",
        "0",
        "none",
    )
