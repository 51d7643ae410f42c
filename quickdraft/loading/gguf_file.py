"""A fast reader of the GGUF container: metadata, tensor infos, and memory-mapped tensor data.

``gguf.GGUFReader`` turns every metadata array item into a numpy view, which takes ~7 s for a
150k-token vocabulary; the format is simple (little-endian key/values, then tensor infos, then
aligned data), so we parse it directly and map the data with numpy. Tensor ``data`` has the shape
GGUFReader gives, so ``gguf.quants.dequantize`` works on it unchanged.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF scalar value types -> struct format (little-endian); 8 = string, 9 = array.
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


class GGUFHeader:
    """A minimal reader of a GGUF v2/v3 key/value section (little-endian only)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self._size = os.fstat(fh.fileno()).st_size

    def _read(self, n: int) -> bytes:
        if n > self._size:  # a damaged length field; do not try to allocate it
            raise ValueError(f"length {n} is larger than the file")
        data = self._fh.read(n)
        if len(data) != n:
            raise ValueError("file ends inside the metadata")
        return bytes(data)

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._read(self._unpack("Q")).decode("utf-8", errors="replace")

    def metadata(self, prefixes: tuple[str, ...], with_tensor_count: bool = False) -> dict[str, Any] | None:
        """Keys starting with ``prefixes``; None when the file needs the general reader."""
        if self._read(4) != b"GGUF":
            raise ValueError("no GGUF magic number")
        if self._unpack("I") not in (2, 3):
            return None
        tensors = self._unpack("Q")
        result: dict[str, Any] = {"__tensor_count__": tensors} if with_tensor_count else {}
        for _ in range(self._unpack("Q")):
            key = self._string()
            value = self._value(self._unpack("I"))
            if key.startswith(prefixes):
                result[key] = value
        return result

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        """(name, dims innermost first, type, offset) of the next tensor info record."""
        name = self._string()
        dims = tuple(self._unpack("Q") for _ in range(self._unpack("I")))
        return name, dims, self._unpack("I"), self._unpack("Q")

    def _value(self, kind: int) -> Any:
        if kind == _GGUF_STRING:
            return self._string()
        if kind == _GGUF_ARRAY:
            return self._array(self._unpack("I"), self._unpack("Q"))
        if kind in _GGUF_SCALARS:
            return self._unpack(_GGUF_SCALARS[kind])
        raise ValueError(f"unknown GGUF value type {kind}")

    def _array(self, kind: int, count: int) -> list[Any]:
        if kind in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[kind]
            data = self._read(struct.calcsize(fmt) * count)
            return list(struct.unpack(f"<{count}{fmt}", data))
        if kind == _GGUF_STRING:
            return self._string_array(count)
        return [self._value(kind) for _ in range(count)]

    def _string_array(self, count: int) -> list[str]:
        """Strings are length-prefixed back to back; read them in one pass over one buffer."""
        out: list[str] = []
        buffer = b""
        pos = 0
        length = struct.Struct("<Q")
        for _ in range(count):
            if len(buffer) - pos < 8:
                buffer = buffer[pos:] + self._fh.read(1 << 20)
                pos = 0
            (n,) = length.unpack_from(buffer, pos)
            pos += 8
            if n > self._size:
                raise ValueError(f"string length {n} is larger than the file")
            while len(buffer) - pos < n:
                more = self._fh.read(max(1 << 20, n))
                if not more:
                    raise ValueError("file ends inside the metadata")
                buffer = buffer[pos:] + more
                pos = 0
            out.append(buffer[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self._fh.seek(pos - len(buffer), 1)  # give back what was read ahead
        return out




@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # float types: [.., innermost]; block types: [rows, row_bytes] uint8

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFFile:
    """``metadata`` (every key) and ``tensors`` (with memory-mapped data) of a GGUF v2/v3 file.

    Raises ValueError (or struct.error) on anything malformed or truncated.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as fh:
            header = GGUFHeader(fh)
            meta = header.metadata(("",), with_tensor_count=True)
            if meta is None:
                raise ValueError("unsupported GGUF version (need 2 or 3)")
            count = int(meta.pop("__tensor_count__"))
            infos = [header.tensor_info() for _ in range(count)]
            pos = fh.tell()
        self.metadata: dict[str, Any] = meta
        align = int(meta.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        size = os.path.getsize(self.path)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = [self._tensor(mm, start, size, *info) for info in infos]

    @staticmethod
    def _tensor(mm: np.memmap, start: int, size: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has GGML type id {kind}, which the gguf package does not know") from None
        if dims and dims[0] % block:
            raise ValueError(
                f"tensor {name} ({qtype.name}) has rows of {dims[0]} values, not a multiple of its block size {block}"
            )
        count = int(np.prod(dims)) if dims else 1
        n_bytes = count // block * type_size
        begin = start + offset
        if begin + n_bytes > size:
            raise ValueError(f"tensor {name} runs past the end of the file (truncated download?)")
        raw = mm[begin : begin + n_bytes]
        rows_shape = tuple(reversed(dims))
        if qtype in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[qtype]).reshape(rows_shape)
        else:
            data = raw.reshape(*rows_shape[:-1], dims[0] // block * type_size)
        return TensorInfo(name, tuple(dims), qtype, data)


def release_pages(view: np.ndarray) -> None:
    """Drop the pages under ``view``, a slice of a :class:`GGUFFile` memory map, from this process's
    resident set once its bytes were copied out (the page cache keeps them; touching the view again
    just maps them back). Without it a model's load briefly holds the file twice: its mapped pages
    and the copies. Does nothing for arrays that are not memory-mapped."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    mm = root.base
    if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or view.nbytes == 0:
        return
    start = view.ctypes.data - root.ctypes.data
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, start + view.nbytes - lo)
    except (OSError, ValueError):  # not supported here: the pages simply stay until the map closes
        pass

