"""safetensors files: a header-only index over one or many files, and a streaming writer.

`Checkpoint.open` reads headers only (names, dtypes, shapes); tensor data is read on
demand, a block of rows at a time, through ``safe_open(...).get_slice`` (memory-mapped),
so nothing larger than the block asked for is ever in memory. A file that is not
safetensors (a ``torch.save`` pickle), truncated, or cut short after it was opened is a
``ValueError`` naming the file (and the tensor being read). `write_file` writes a
safetensors file from tensors given as *producers* of row blocks, so a table larger
than RAM can be re-sharded or converted one block at a time.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .._progress import byte_bar

__all__ = ["TensorInfo", "Checkpoint", "Entry", "write_file", "write_files", "INDEX_NAME",
           "ST_DTYPES", "dtype_name", "human_bytes"]

INDEX_NAME = "model.safetensors.index.json"
_INDEX_SUFFIX = ".safetensors.index.json"

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def human_bytes(n: int) -> str:
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


def read_header(file: Path) -> tuple[dict, dict[str, tuple[torch.dtype, tuple, int, int]]]:
    """``(metadata, {key: (dtype, shape, begin, end)})`` of one file, byte offsets from the file start.

    Reads the 8-byte length and the JSON header only, and checks them as safetensors
    does: offsets contiguous, sizes matching shapes, and the data ending exactly at the
    end of the file (so a truncated file is caught before anything is read).
    """
    if not file.exists():
        raise ValueError(f"path: {file} does not exist")
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
    that index) or a list of files. Opening reads and checks the headers only
    (`read_header`); a key in two files, an index entry its file lacks, or a bad file is
    a ``ValueError``.

    Data is read by `read`: ``safe_open(...).get_slice`` (memory-mapped) where the
    file can be mapped, else positioned reads of just the rows asked for. A file whose
    size changed since it was opened (truncated, or rewritten) is a ``ValueError``
    naming the file and the key, before any of its data is touched.
    """

    def __init__(self, files: list[Path], root: Path):
        self.root = root
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        self._handles: dict[Path, object] = {}
        self._sizes: dict[Path, int] = {}
        for file in files:
            metadata, tensors = read_header(file)
            self._sizes[file] = file.stat().st_size
            for k, v in metadata.items():
                self.metadata.setdefault(k, v)
            for key, (dtype, shape, begin, end) in tensors.items():
                if key in self.tensors:
                    raise ValueError(f"{key}: found in two files, {self.tensors[key].file} and {file}")
                self.tensors[key] = TensorInfo(key, file, dtype, shape)
                self._offsets[key] = (begin, end)

    @classmethod
    def open(cls, path) -> Checkpoint:
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

    def _handle(self, file: Path):
        """A cached ``safe_open`` handle, or None where the file cannot be memory-mapped."""
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception:  # e.g. mmap refused for a file larger than the address space allows
                self._handles[file] = None
        return self._handles[file]

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key`` (the whole tensor when both are None), read from the file.

        Only those rows are read; the result is a new CPU tensor.
        """
        info = self.info(key)
        whole = start is None and stop is None
        if not whole and not info.shape:
            raise ValueError(f"{key}: a 0-d tensor has no rows to slice")
        self._check_size(info)          # a memory-mapped read past the end of a cut file would crash
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
        """Rows ``[a, b)`` by a positioned read (no memory map)."""
        begin, end = self._offsets[info.key]
        rows = info.shape[0] if info.shape else 1
        row_bytes = (end - begin) // rows if rows else 0
        b = max(a, b)
        out = torch.empty(((b - a),) + info.shape[1:] if info.shape else (), dtype=info.dtype)
        n = (b - a) * row_bytes
        if n:
            with open(info.file, "rb") as fh:
                fh.seek(begin + a * row_bytes)
                got = fh.readinto((ctypes.c_char * n).from_address(out.data_ptr()))
            if got != n:
                raise ValueError(f"{info.key}: {info.file} ended after {got} of the {n} bytes of rows "
                                 f"[{a}, {b}) (truncated file?)")
        return out

    def read_rows(self, key: str, start: int, stop: int, *,
                  block_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows ``[start, stop)`` of ``key`` in blocks of at most ``block_rows``: ``(first row, block)``."""
        for a in range(start, stop, max(block_rows, 1)):
            b = min(a + block_rows, stop)
            yield a, self.read(key, a, b)


# ---- writing -----------------------------------------------------------------------------------
@dataclass
class Entry:
    """One tensor to write: its key, dtype and shape, and a producer of its row blocks in order.

    ``produce()`` yields CPU tensors of ``dtype`` whose rows, concatenated along dim 0,
    make the tensor (one block for a 0-d tensor).
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _write_tensor(fh, t: torch.Tensor) -> int:
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n:
        fh.write((ctypes.c_char * n).from_address(t.data_ptr()))
    return n


def write_file(path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` as one safetensors file, streaming each tensor block by block.

    The file is written to ``path + ".tmp"`` and renamed when complete, so an
    interrupted write never leaves a readable half file at ``path``.
    """
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        if e.dtype not in _ST_NAMES:
            raise TypeError(f"{e.key}: dtype {e.dtype} cannot be stored in safetensors")
        header[e.key] = {"dtype": _ST_NAMES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    bar = byte_bar(offset, desc=path.name)                 # a progress bar on a terminal, silent otherwise
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)))
            fh.write(blob)
            for e in entries:
                written = 0
                for block in e.produce():
                    if block.dtype != e.dtype:
                        raise TypeError(f"{e.key}: a block came as {block.dtype}, expected {e.dtype}")
                    n = _write_tensor(fh, block)
                    written += n
                    bar.update(n)
                if written != e.nbytes:
                    raise ValueError(f"{e.key}: the producer gave {written} bytes, expected {e.nbytes} "
                                     f"for shape {list(e.shape)}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    os.replace(tmp, path)


def write_files(directory, entries: list[Entry], *, max_file_bytes: int | None = None,
                metadata: dict[str, str] | None = None, stem: str = "model") -> list[Path]:
    """Write ``entries`` into ``directory``: one ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes`` each (a larger
    tensor gets a file of its own) plus ``model.safetensors.index.json``, the Hugging Face
    layout. Returns the files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if max_file_bytes is not None and groups[-1] and size + e.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    if len(groups) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    index = directory / INDEX_NAME
    if index.exists():
        index.unlink()
    written = []
    for name, group in zip(names, groups, strict=True):
        write_file(directory / name, group, metadata)
        written.append(directory / name)
    if len(groups) > 1:
        weight_map = {e.key: name for name, group in zip(names, groups, strict=True) for e in group}
        total = sum(e.nbytes for e in entries)
        with open(index, "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return written
