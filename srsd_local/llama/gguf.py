"""A small reader (and writer) of GGUF headers: the metadata, never the tensors.

The layout (public, see ggml's docs/gguf.md): the magic ``GGUF``, a uint32 version (2 or 3;
version 1 had 32-bit counts and is long gone), a uint64 tensor count, a uint64 key/value
count, then the key/values: a string key (uint64 length + UTF-8 bytes), a uint32 value type
and the value (an array is a uint32 element type, a uint64 count and the elements). All
little-endian. The reader stops after the key/values, so it reads a few megabytes at most
(mostly the tokenizer's vocabulary) whatever the size of the model.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)

# value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, \
    FLOAT64 = range(13)
_SCALARS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
            FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_MAX_KV = 1 << 20  # more key/values than this: not a real GGUF
_MAX_STRING = 1 << 28  # one string longer than 256 MiB: corrupt
_MAX_ARRAY = 1 << 31
_KEEP_ARRAY = 64  # arrays up to this many elements are read; longer ones are only counted


class GGUFError(ValueError):
    """A file that is not a readable GGUF (not GGUF, an unknown version, cut short)."""


@dataclass(frozen=True)
class GGUFArray:
    """A long array (a vocabulary, merges, ...): its element type and length only."""

    type: int
    count: int


@dataclass
class GGUFHeader:
    version: int
    tensor_count: int
    metadata: dict[str, Any] = field(default_factory=dict)
    size: int = 0  # bytes from the start of the file to the end of the key/values

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    """Sequential reads from a file through a 1 MiB buffer (strings are skipped cheaply)."""

    def __init__(self, f: IO[bytes], what: str) -> None:
        self.f, self.what = f, what
        self.buf = b""
        self.pos = 0  # in buf
        self.offset = 0  # of buf[0] in the file

    def _need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        rest = self.buf[self.pos:]
        more = self.f.read(max(n - len(rest), 1 << 20))
        self.offset += self.pos
        self.buf, self.pos = rest + more, 0
        if len(self.buf) < n:
            raise GGUFError(f"{self.what} is cut short: its metadata ends at byte "
                            f"{self.offset + len(self.buf)}, inside a value")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise GGUFError(f"{self.what} has a string of {n} bytes: the file is corrupt")
        self._need(n)
        s = self.buf[self.pos: self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.unpack("<Q")
            if n > _MAX_STRING:
                raise GGUFError(f"{self.what} has a string of {n} bytes: the file is corrupt")
            if self.pos + n <= len(self.buf):
                self.pos += n
            else:
                self._need(n)
                self.pos += n

    def skip(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            self.pos += n
            return
        n -= len(self.buf) - self.pos
        self.buf, self.pos = b"", 0
        here = self.f.tell()
        end = self.f.seek(0, 2)
        if here + n > end:
            raise GGUFError(f"{self.what} is cut short: its metadata ends at byte {end}, "
                            "inside an array")
        self.f.seek(here + n)
        self.offset = here + n

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count > _MAX_ARRAY:
                raise GGUFError(f"{self.what} has an array of {count} values: corrupt")
            if count <= _KEEP_ARRAY:
                return [self.value(etype) for _ in range(count)]
            if etype in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[etype]))
            elif etype == STRING:
                self.skip_strings(count)
            else:  # arrays of arrays: read through them
                for _ in range(count):
                    self.value(etype)
            return GGUFArray(etype, count)
        raise GGUFError(f"{self.what} has a value of unknown type {vtype}: accepted are "
                        f"types 0..12 of the GGUF format")

    @property
    def tell(self) -> int:
        return self.offset + self.pos


def read_header(file: str | Path | IO[bytes], what: str | None = None) -> GGUFHeader:
    """The version, tensor count and metadata of a GGUF file (arrays longer than 64 values
    are returned as `GGUFArray`: type and length). Raises GGUFError when the file is not a
    GGUF, has an unknown version or ends inside its metadata."""
    if isinstance(file, (str, Path)):
        with open(file, "rb") as f:
            return read_header(f, what or str(file))
    r = _Reader(file, what or "the file")
    try:
        r._need(4)
    except GGUFError:
        pass  # shorter than the magic: reported below
    head = r.buf[:4]
    r.pos = len(head)
    if head != GGUF_MAGIC:
        raise GGUFError(f"{r.what} is not a GGUF file (it starts with {head!r}, a GGUF starts "
                        f"with {GGUF_MAGIC!r})")
    version = r.unpack("<I")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{r.what} is GGUF version {version}; accepted are versions "
                        f"{', '.join(map(str, GGUF_VERSIONS))}")
    tensors, kvs = r.unpack("<Q"), r.unpack("<Q")
    if kvs > _MAX_KV:
        raise GGUFError(f"{r.what} claims {kvs} metadata entries: the file is corrupt")
    meta: dict[str, Any] = {}
    for _ in range(kvs):
        key = r.string()
        meta[key] = r.value(r.unpack("<I"))
    return GGUFHeader(version=version, tensor_count=tensors, metadata=meta, size=r.tell)


# -- writing (small test files, or a header-only copy) --------------------------------------
def _typed(value: Any) -> tuple[int, Any]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int):
        return value  # (type, value) given explicitly
    if isinstance(value, bool):
        return BOOL, value
    if isinstance(value, int):
        return (UINT32 if 0 <= value < 1 << 32 else INT64), value
    if isinstance(value, float):
        return FLOAT32, value
    if isinstance(value, str):
        return STRING, value
    if isinstance(value, (list, tuple)):
        return ARRAY, list(value)
    raise TypeError(f"cannot write {value!r} to a GGUF: accepted are bool, int, float, str, "
                    "lists of those, or (type, value)")


def _encode(vtype: int, value: Any) -> bytes:
    if vtype in _SCALARS:
        return struct.pack(_SCALARS[vtype], value)
    if vtype == STRING:
        data = value.encode("utf-8")
        return struct.pack("<Q", len(data)) + data
    if vtype == ARRAY:
        etype = _typed(value[0])[0] if value else UINT32
        return struct.pack("<IQ", etype, len(value)) + b"".join(_encode(etype, v)
                                                                for v in value)
    raise TypeError(f"unknown GGUF value type {vtype}")


def encode_header(metadata: dict[str, Any], tensor_count: int = 0, version: int = 3) -> bytes:
    """The bytes of a GGUF header with these key/values (types inferred, or given as
    `(type, value)`) and no tensor infos."""
    out = [GGUF_MAGIC, struct.pack("<IQQ", version, tensor_count, len(metadata))]
    for key, value in metadata.items():
        vtype, v = _typed(value)
        out += [_encode(STRING, key), struct.pack("<I", vtype), _encode(vtype, v)]
    return b"".join(out)
