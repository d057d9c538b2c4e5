"""safetensors files: a header-only index over one or many files, and a streaming writer.

Reading goes through the ``safetensors`` library: `Checkpoint.open` opens each file with
``safe_open`` (which checks the header as safetensors does: JSON, dtypes, offsets contiguous,
sizes matching shapes, the data covering the file exactly) and takes the metadata, the keys
and each tensor's dtype and shape from it (``metadata()``, ``offset_keys()``,
``get_slice(key).get_dtype()`` / ``get_shape()``); tensor data is read on demand, a block of
rows at a time, through ``get_slice(key)[a:b]`` (memory-mapped), so nothing larger than the
block asked for is ever in memory. FP8 (``F8_E4M3``, ``F8_E5M2``) too: the torch framework
makes float8 tensors and slices in safetensors releases since early 2024 (an older one
fails such a read with a ``ValueError`` naming the key and the file).

Hand-written, because the library does not cover it (each place says why): the diagnosis of a
file ``safe_open`` refuses (its errors name neither the file nor the tensor cut off, nor a
``torch.save`` file as one), the positioned reads of a file it cannot memory-map (it has no
other way to read, and does not expose the tensors' byte offsets), the size check of a mapped
file before each read (a mapped read past the end of a file cut short after opening would
crash the process), and the streaming writer (``safetensors.torch.save_file`` needs every
tensor in memory at once). A file that is not safetensors (a ``torch.save`` pickle),
truncated, or cut short after it was opened is a ``ValueError`` naming the file (and the
tensor being read). The writer (`Entry`, `write_file`, `write_files`) is ``ple.io.writer``'s,
re-exported here.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._deprecation import deprecated_parameter
from .writer import INDEX_NAME, ST_DTYPES, Entry, bytes_of, write_file, write_files

__all__ = ["TensorInfo", "Checkpoint", "Entry", "write_file", "write_files", "INDEX_NAME",
           "ST_DTYPES", "dtype_name", "human_bytes"]

if TYPE_CHECKING:
    from typing import Literal, TypeAlias, TypedDict

    from torch.types import Device

    from ..config import PLEConfig
    from ..quant import Scheme

    # The argument types of ``ple.io``'s entry points, one home for all (annotations only).
    # What `Checkpoint.open` takes: a file, a directory, an index file, a list of files, or a Checkpoint.
    CheckpointSource: TypeAlias = ("str | os.PathLike[str] | list[str | os.PathLike[str]] "
                                   "| tuple[str | os.PathLike[str], ...] | Checkpoint")
    # What ``config=`` takes: a PLEConfig, a dict, a preset name or a config.json path (None: found).
    ConfigSource: TypeAlias = "PLEConfig | dict[str, Any] | str | os.PathLike[str] | None"
    # What ``table_dtype=`` takes: None (keep), a float dtype, a `Scheme`, or a name in ``save.TABLE_DTYPES``.
    TableDtype: TypeAlias = "torch.dtype | Scheme | str | None"
    # What ``offload=`` takes: False (the table on ``device``), True / "host" (host memory), "disk" (its files).
    Offload: TypeAlias = "bool | Literal['host', 'disk']"

    class LoadOptions(TypedDict, total=False):
        """``load_layer``'s keyword arguments but ``return_report``, for its overloads (the defaults: its own)."""

        prefix: str | None
        backend: str
        device: Device
        dtype: torch.dtype | None
        offload: Offload
        cache_bytes: int | None
        block_bytes: int
        overlay: str | os.PathLike[str] | None
        overlay_bytes: int | None
        overlay_dtype: torch.dtype | None

_INDEX_SUFFIX = ".safetensors.index.json"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the file header."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


_MAX_HEADER = 100 << 20          # safetensors' own limit on the JSON header


def _bad(file: Path, size: int, why: str) -> ValueError:
    return ValueError(f"path: {file} is not a readable safetensors file ({size} bytes): {why}")


def _pickle_kind(head: bytes) -> str | None:
    """What a file starting with ``head`` is if it is a ``torch.save`` output: None if it is not."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive"                    # torch.save's default format
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle"                         # torch.save(..., _use_new_zipfile_serialization=False)
    return None


def _not_safetensors(file: Path, size: int, head: bytes, why: str) -> ValueError:
    """The error for a header that does not parse: a torch.save file is named as one."""
    kind = _pickle_kind(head)
    if kind is None:
        return _bad(file, size, why)
    return ValueError(f"path: {file} is a torch.save/pickle file ({kind}), not safetensors; load it with "
                      f"torch.load(path, weights_only=True) and write it with ple.io.save (a PLE layer) or "
                      f"safetensors.torch.save_file")


def _library_header(file: Path, size: int,
                    handle: Any) -> tuple[dict[str, str], dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """``(metadata, {key: (dtype, shape)})`` of a file ``safe_open`` opened (so checked), keys in file order."""
    keys = handle.offset_keys() if hasattr(handle, "offset_keys") else handle.keys()   # older: sorted by name
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key in keys:
        piece = handle.get_slice(key)
        name = piece.get_dtype()
        if name not in ST_DTYPES:                   # one the library knows and ple does not (F8_E8M0, U16, ...)
            raise _bad(file, size, f"{key}: unsupported dtype {name}")
        tensors[key] = (ST_DTYPES[name], tuple(int(d) for d in piece.get_shape()))
    return handle.metadata() or {}, tensors


def _parse_header(file: Path) -> tuple[dict[str, str], dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """``(metadata, {key: (dtype, shape, begin, end)})`` of one file, byte offsets from the file start.

    Hand-written, for the files ``safe_open`` refuses, and only for them: it checks the
    header as safetensors does (offsets contiguous, sizes matching shapes, the data ending
    exactly at the end of the file), but says which file, which tensor and what is wrong
    (a ``torch.save`` file named as one, the tensor a truncated file cuts off, trailing
    bytes), where the library's error names neither. A file it finds sound is one the
    library could not map: its offsets, which the library does not expose (its maintainers
    leave that to pure Python), serve `Checkpoint`'s
    positioned reads. Reads the 8-byte length and the JSON header only.
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _bad(file, size, "truncated before the header length (truncated file?)")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise _not_safetensors(file, size, head, f"header length {n} does not fit the file (truncated "
                                                     f"file?)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _not_safetensors(file, size, head, f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(file, size, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    spans = []
    for key, entry in header.items():
        try:
            name, (begin, end) = entry["dtype"], entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise _bad(file, size, f"{key}: a malformed header entry {entry!r}") from None
        if name not in ST_DTYPES:
            raise _bad(file, size, f"{key}: unsupported dtype {name}")
        dtype = ST_DTYPES[name]
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise _bad(file, size, f"{key}: data_offsets {[begin, end]} do not hold {name} {list(shape)}")
        tensors[key] = (dtype, shape, 8 + n + begin, 8 + n + end)
        spans.append((begin, end, key))
    spans.sort()
    pos = 0
    for begin, end, key in spans:
        if begin != pos:
            raise _bad(file, size, f"{key}: data_offsets leave a gap or overlap at byte {pos}")
        pos = end
    if 8 + n + pos > size:
        cut = [key for begin, end, key in spans if 8 + n + end > size]
        raise _bad(file, size, f"the header describes {8 + n + pos} bytes (truncated file?): the data of "
                               f"{cut[0]}{f' and {len(cut) - 1} more tensor(s)' if len(cut) > 1 else ''} "
                               f"ends past the end of the file")
    if 8 + n + pos < size:
        raise _bad(file, size, f"the header describes {8 + n + pos} bytes (trailing bytes?)")
    return metadata, tensors


class Checkpoint:
    """Header-only index of a checkpoint: ``key -> TensorInfo`` over all its files.

    Open with `Checkpoint.open` from a ``.safetensors`` file, a directory (its
    ``model.safetensors.index.json`` if present, else its only ``*.safetensors.index.json``,
    else every ``*.safetensors`` in it), an index file itself (like its directory, with
    that index) or a list of files. Opening reads and checks the headers only (``safe_open``;
    `_parse_header` says what is wrong with a file it refuses); a key in two files, an index
    entry its file lacks, or a bad file is a ``ValueError``.

    Data is read by `read`: ``safe_open(...).get_slice`` (memory-mapped) where the
    library can map the file, else positioned reads of just the rows asked for. A file whose
    size changed since it was opened (truncated, or rewritten) is a ``ValueError``
    naming the file and the key, before any of its data is touched.
    """

    def __init__(self, files: list[Path], root: Path) -> None:
        self.root = root
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._offsets: dict[str, tuple[int, int]] = {}      # byte ranges, of the files read unmapped only
        self._handles: dict[Path, Any] = {}                 # safe_open handles (None: refused)
        self._sizes: dict[Path, int] = {}
        for file in files:
            if not file.exists():
                raise ValueError(f"path: {file} does not exist")
            self._sizes[file] = size = file.stat().st_size
            handle = self._handle(file)
            if handle is not None:
                metadata, tensors = _library_header(file, size, handle)
            else:                                  # refused: say why, or read it unmapped (`_parse_header`)
                metadata, parsed = _parse_header(file)
                tensors = {key: (dtype, shape) for key, (dtype, shape, _, _) in parsed.items()}
                self._offsets.update({key: (begin, end) for key, (_, _, begin, end) in parsed.items()})
            for k, v in metadata.items():
                self.metadata.setdefault(k, v)
            for key, (dtype, shape) in tensors.items():
                if key in self.tensors:
                    raise ValueError(f"{key}: found in two files, {self.tensors[key].file} and {file}")
                self.tensors[key] = TensorInfo(key, file, dtype, shape)

    @classmethod
    def open(cls, path: CheckpointSource) -> Checkpoint:
        if isinstance(path, Checkpoint):
            return path
        if isinstance(path, (list, tuple)):
            files = [Path(p) for p in path]
            if not files:
                raise ValueError("path: expected at least one file, got an empty list")
            return cls(files, files[0].parent)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file, a directory or a list of files, got "
                            f"{type(path).__name__}")
        path = Path(path)
        if path.is_dir():
            indexes = sorted(path.glob("*" + _INDEX_SUFFIX))
            if (path / INDEX_NAME).exists() or len(indexes) == 1:
                return cls._from_index(path / INDEX_NAME if (path / INDEX_NAME).exists() else indexes[0])
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"path: no *.safetensors files in the directory {path}")
            return cls(files, path)
        if not path.exists():
            raise ValueError(f"path: {path} does not exist")
        if path.name.endswith(_INDEX_SUFFIX):
            return cls._from_index(path)
        return cls([path], path.parent)

    @classmethod
    def _from_index(cls, index: Path) -> Checkpoint:
        """The files an index's ``weight_map`` names (beside it), checked against their headers."""
        path = index.parent
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"path: {index} is not a safetensors index (JSON with a 'weight_map'): "
                             f"{e}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"path: {index} has no 'weight_map'")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ValueError(f"path: {index} lists files that do not exist: {missing}")
        ckpt = cls([path / n for n in names], path)
        for key, name in weight_map.items():
            info = ckpt.tensors.get(key)
            if info is None or info.file.name != name:
                raise ValueError(f"{key}: {index} places it in {name}, which does not hold it")
        return ckpt

    # ---- queries -------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            raise ValueError(f"{key}: missing from the checkpoint")
        return self.tensors[key]

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def _handle(self, file: Path) -> Any:
        """A cached ``safe_open`` handle, or None where the library refuses the file (a bad file, or one it
        cannot memory-map, e.g. larger than the address space allows: `_parse_header` tells them apart)."""
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception:  # its errors name neither the file nor the problem's tensor: _parse_header does
                self._handles[file] = None
        return self._handles[file]

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key`` (the whole tensor when both are None), read from the file.

        Only those rows are read. The result is a CPU tensor over safetensors' own mapping of the
        file (no copy): clone it to keep it past a change of the file (``load_layer`` does).
        """
        info = self.info(key)
        whole = start is None and stop is None
        if not whole and not info.shape:
            raise ValueError(f"{key}: a 0-d tensor has no rows to slice")
        # Hand-written: a memory-mapped read past the end of a file cut short since it was opened would crash
        # the process (SIGBUS), and the library maps the file once, at open, without checking again.
        self._check_size(info)
        f = self._handle(info.file)
        if f is not None:
            try:
                return f.get_tensor(key) if whole else f.get_slice(key)[start:stop]
            except Exception as e:      # safetensors' own errors, named here
                raise ValueError(f"{key}: reading it from {info.file} failed: {type(e).__name__}: "
                                 f"{e}") from None
        a, b = slice(start, stop).indices(info.shape[0])[:2] if info.shape else (0, 1)
        return self._pread(info, a, b)

    def _check_size(self, info: TensorInfo) -> None:
        try:
            size = info.file.stat().st_size
        except OSError as e:
            raise ValueError(f"{info.key}: {info.file} can no longer be read ({e})") from None
        if size != self._sizes[info.file]:
            raise ValueError(f"{info.key}: {info.file} is {size} bytes now, {self._sizes[info.file]} when the "
                             f"checkpoint was opened (truncated file, or rewritten since?)")

    def _pread(self, info: TensorInfo, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` by a positioned read, for a file the library cannot map (it reads through a map only)."""
        begin, end = self._offsets[info.key]
        rows = info.shape[0] if info.shape else 1
        row_bytes = (end - begin) // rows if rows else 0
        b = max(a, b)
        out = torch.empty(((b - a),) + info.shape[1:] if info.shape else (), dtype=info.dtype)
        n = (b - a) * row_bytes
        if n:
            with open(info.file, "rb") as fh:
                fh.seek(begin + a * row_bytes)
                got = fh.readinto(bytes_of(out))
            if got != n:
                raise ValueError(f"{info.key}: {info.file} ended after {got} of the {n} bytes of rows "
                                 f"[{a}, {b}) (truncated file?)")
        return out

    @deprecated_parameter("block_rows", "rows_per_block", since="0.1.0")
    def read_rows(self, key: str, start: int, stop: int, *,
                  rows_per_block: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows ``[start, stop)`` of ``key`` in blocks of at most ``rows_per_block``: ``(first row, block)``.
        (The keyword ``block_rows=`` still works and warns: deprecated.)"""
        for a in range(start, stop, max(rows_per_block, 1)):
            b = min(a + rows_per_block, stop)
            yield a, self.read(key, a, b)
