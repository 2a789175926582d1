"""A fast reader for GGUF metadata and tensor locations.

``gguf.GGUFReader`` builds a numpy memmap view for every element of every
metadata array; with a 49k-token vocabulary that takes seconds (tens under
load). This reader walks the header once with ``struct`` on an ``mmap`` and
reads numeric arrays in bulk, so arch configs and tokenizer settings come back
in milliseconds. The parsed header holds no mapping: tensor data is read
through ``GGUFFile.mapped()``, whose pages a loader hands back tensor by tensor
(``TensorData.release``) and which is unmapped when the load ends, so a file's
pages do not stay in the process's resident memory beside the weights made
from them.

Format (GGUF v2/v3, little-endian): magic, version, tensor count, KV count; the
KV pairs; per tensor its name, dims (innermost first), ggml type and offset;
then the data section at the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): [out, in] for matrices
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; ``metadata`` maps keys to Python values."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle, _map_file(handle.fileno()) as buf:
            self._map = buf  # the header's parse only; nothing may keep a view of it
            self._parse()
        del self._map

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version}")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)

        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment

        self.tensors: list[GGUFTensorInfo] = []
        for name, shape, ggml_type, offset in infos:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(shape)) if shape else 1
            nbytes = n_elems // block * type_size
            self.tensors.append(GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes))
        self.tensor_by_name = {info.name: info for info in self.tensors}

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + length
        return self._map[start : self._pos].decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            elem_type, count = self._unpack("<IQ")
            if elem_type in _SCALARS:
                dtype = np.dtype(_SCALARS[elem_type][1]).newbyteorder("<")
                arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(elem_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self._unpack(_SCALARS[value_type][0])[0]

    @contextlib.contextmanager
    def mapped(self) -> Iterator[TensorData]:
        """The file's tensor data, mapped for the duration of the ``with``."""
        with open(self.path, "rb") as handle, _map_file(handle.fileno()) as buf:
            yield TensorData(buf)


class TensorData:
    """Tensor bytes of a mapped GGUF file (``GGUFFile.mapped``)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self._map = buf

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [*outer dims, bytes per row] (what
        ``gguf.quants.dequantize`` takes), backed by the memory map."""
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1] if info.shape else ()
        return data.reshape(*rows, -1)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's pages from this process's resident set (the file
        stays in the page cache); reading them again faults them back in."""
        start = info.offset - info.offset % mmap.PAGESIZE
        end = min(info.offset + info.nbytes, len(self._map))
        if end > start and hasattr(mmap, "MADV_DONTNEED"):  # not on Windows
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


@contextlib.contextmanager
def _map_file(fileno: int) -> Iterator[mmap.mmap]:
    """A read-only map of the file, unmapped on exit unless a caller still holds a
    view of it (then it is unmapped when the last view goes)."""
    buf = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)
    try:
        yield buf
    finally:
        with contextlib.suppress(BufferError):
            buf.close()


@functools.lru_cache(maxsize=4)
def _cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed GGUF file, cached per (path, mtime, size)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _cached(str(resolved), stat.st_mtime_ns, stat.st_size)
