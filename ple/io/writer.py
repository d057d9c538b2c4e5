"""The streaming safetensors writer, and the format's names (dtypes, the index file) that ``ple.io.files`` reads by.

`write_file` writes a safetensors file from tensors given as *producers* of row blocks
(`Entry`), so a table larger than RAM can be re-sharded or converted one block at a time;
`write_files` splits entries into Hugging Face-style shards with an index.

Hand-written, because the library has no streaming writer: ``safetensors.torch.save_file``
(and ``save``) takes a dict of whole tensors, all in memory at once. The header is the
format's (8-byte little-endian length, the JSON header padded with spaces to 8 bytes, the
data in header order); ``safetensors`` reads every file this writes
(``tests/io/test_io.py::test_streaming_writer_matches_safetensors``). ``ST_DTYPES`` spells the
format's dtype names, which the library keeps private.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch

from .._progress import byte_bar
from . import _pipeline
from ._pipeline import WriteBack, ahead, write_chunks

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["INDEX_NAME", "ST_DTYPES", "Entry", "write_file", "write_files", "bytes_of", "fsync_dir"]

INDEX_NAME = "model.safetensors.index.json"

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def bytes_of(t: torch.Tensor) -> Buffer:
    """The bytes of the contiguous CPU tensor ``t`` as a buffer sharing its memory (any dtype: bfloat16 and
    FP8 included, which numpy has not, go through a uint8 view)."""
    # A uint8 ndarray; numpy's stubs declare its buffer protocol for Python >= 3.12 only.
    return cast("Buffer", t.reshape(-1).view(torch.uint8).numpy())


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


def _write_tensor(fh: IO[bytes], t: torch.Tensor, back: WriteBack | None, at: int) -> int:
    """Write ``t``'s bytes at the end of ``fh`` (which holds ``at`` bytes); returns how many were written."""
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n:
        write_chunks(fh.write, memoryview(bytes_of(t)).cast("B"), back, at)
    return n


def _blocks(entries: list[Entry]) -> Generator[tuple[int, torch.Tensor | None], None, None]:
    """``(i, block)`` for each block of each entry in order, then ``(i, None)`` at the end of entry ``i``."""
    for i, e in enumerate(entries):
        for block in e.produce():
            yield i, block
        yield i, None


def write_file(path: str | os.PathLike[str], entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` as one safetensors file, streaming each tensor block by block.

    The file is written to ``path + ".tmp"``, flushed to disk (fsync) and renamed when complete
    (the directory fsynced too), so an interrupted write never leaves a readable half file at ``path``.

    A file of at least ``PIPELINE_BYTES`` is written overlapped (``ple.io._pipeline``): the entries'
    producers run in a thread of their own, one block ahead of the one being written (under
    ``torch.no_grad()``; an error one raises comes out here as raised), and the disk starts writing each
    16 MiB as it lands, so the final fsync waits for the last 64 MiB only.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        # Sorted: the same file, byte for byte, whatever order the metadata came in (safetensors' own reader
        # gives a file's metadata in a different order in each process).
        header["__metadata__"] = dict(sorted((str(k), str(v)) for k, v in metadata.items()))
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
            at = 8 + len(blob)
            big = offset >= _pipeline.PIPELINE_BYTES
            back = WriteBack(fh.fileno()) if big else None
            stream = ahead(_blocks(entries)) if big else _blocks(entries)
            written = 0
            try:
                for i, block in stream:
                    e = entries[i]
                    if block is None:                      # the end of entry i
                        if written != e.nbytes:
                            raise ValueError(f"{e.key}: the producer gave {written} bytes, expected {e.nbytes} "
                                             f"for shape {list(e.shape)}")
                        written = 0
                        continue
                    if block.dtype != e.dtype:
                        raise TypeError(f"{e.key}: a block came as {block.dtype}, expected {e.dtype}")
                    n = _write_tensor(fh, block, back, at)
                    written += n
                    at += n
                    bar.update(n)
            finally:                                       # stops a thread making blocks ahead, at once
                stream.close()
            fh.flush()
            os.fsync(fh.fileno())                          # the bytes are on disk before the name points at them
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable (fsync the directory; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_files(directory: str | os.PathLike[str], entries: list[Entry], *, max_file_bytes: int | None = None,
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
