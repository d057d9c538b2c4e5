"""The files of an overlay directory (`ple.io.disk_table.overlay.OverlayStore`): its segments, its manifest,
its lock; and the row `Layout`. (The store's index, off the heap: ``_index``.)

A *segment* (``seg-<serial>.safetensors``) is an immutable safetensors file of rows: ``ids`` (int64
``[n]``, sorted and distinct: the store searches them where they lie, mapped), ``rows`` (``[n, D]``) and
one ``state.<name>`` tensor per optimizer state (``[n, *shape]``), in order of decreasing item size so
that every tensor is aligned. It is written in place under its final name and fsynced (`write_segment`); it
means nothing until a manifest lists it, so a half-written one is only a leftover, deleted at the next
open. Each tensor's bytes (and the header's) have a CRC-32, kept by the manifest.

The *manifest* (``manifest.json``) is the overlay: its generation, the row layout, the base's fingerprint,
the caller's ``meta`` and the list of segments with their sizes, checksums and live rows (those no later
segment replaces: the merges' guide; a manifest of an earlier version lacks them, and the store counts them
at open), in the order they were written (a row in a later segment replaces the same row in an earlier
one). It carries a CRC-32 of its own body. `write_manifest` writes it to ``manifest.json.tmp``, fsyncs it,
renames it over ``manifest.json`` and fsyncs the directory: the switch from one generation to the next is
that one rename.

The *lock* (``overlay.lock``, `DirLock`) is in ``_lock``: one writer at a time, readers shared.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...files import dtype_name
from ...writer import ST_DTYPES, bytes_of, fsync_dir
from ..mapped import MappedFile, map_view
from ._lock import LOCK, DirLock

__all__ = ["MANIFEST", "LOCK", "Layout", "Segment", "DirLock", "write_segment", "read_manifest",
           "write_manifest", "segment_name", "clean_leftovers", "jsonable", "differences",
           "as_ids", "parse_layout"]

MANIFEST = "manifest.json"
FORMAT = "ple.overlay"
VERSION = 1
_SEGMENT_RE = re.compile(r"seg-\d+\.safetensors")
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_READ = 4 << 20                 # bytes read at a time when checksumming, into one buffer


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` (``os.preadv``; ``os.pread`` and a copy where it is missing)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    chunk = os.pread(fd, len(view), offset)
    view[: len(chunk)] = chunk
    return len(chunk)


def segment_name(serial: int) -> str:
    return f"seg-{serial:08d}.safetensors"


@dataclass(frozen=True)
class Layout:
    """What a row holds: ``dim`` values of ``dtype``, and per state ``(name, shape, dtype)``."""

    dim: int
    dtype: torch.dtype
    state: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, dim: int, dtype: torch.dtype, state: dict[str, Any] | None) -> Layout:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim: expected a positive int, got {dim!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in _ST_NAMES:
            raise ValueError(f"dtype: expected a float dtype safetensors stores (torch.bfloat16, torch.float32 "
                             f"...), got {dtype!r}")
        spec = []
        for name, value in (state or {}).items():
            try:
                shape, sdtype = value
                shape = tuple(int(s) for s in shape)
            except (TypeError, ValueError):
                raise ValueError(f"state: {name!r} should be (shape_per_row, dtype), got {value!r}") from None
            if not isinstance(name, str) or not name or not isinstance(sdtype, torch.dtype) \
                    or sdtype not in _ST_NAMES or any(s < 1 for s in shape):
                raise ValueError(f"state: {name!r}: {value!r} is not (shape_per_row, dtype) with a dtype "
                                 f"safetensors stores")
            spec.append((name, shape, sdtype))
        return cls(dim, dtype, tuple(spec))

    @property
    def fields(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(key, dtype, shape of one row)`` of what a row holds: ``rows``, then ``state.<name>`` each."""
        return [("rows", self.dtype, (self.dim,))] + [(f"state.{n}", dt, s) for n, s, dt in self.state]

    @property
    def file_parts(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The tensors of a segment file in file order: ``ids``, then the fields by decreasing item size."""
        parts = [("ids", torch.int64, ())] + self.fields
        return sorted(parts, key=lambda p: -p[1].itemsize)

    @property
    def row_bytes(self) -> int:
        return sum(dt.itemsize * math.prod(shape) for _, dt, shape in self.fields)

    def values(self, n: int, rows: torch.Tensor, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``rows`` and ``states`` checked against the layout and converted: ``{key: [n, *shape]}`` on the CPU."""
        names = {name for name, _, _ in self.state}
        if set(states) != names:
            raise ValueError(f"states: expected the names {sorted(names)}, got {sorted(states)}")
        given = {"rows": rows} | {f"state.{k}": v for k, v in states.items()}
        out = {}
        for key, dt, shape in self.fields:
            t = given[key]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n, *shape):
                raise ValueError(f"{'rows' if key == 'rows' else 'states'}: {key} should be {[n, *shape]}, "
                                 f"got {list(getattr(t, 'shape', [])) or type(t).__name__}")
            out[key] = t.detach().to("cpu", dt)
        return out

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "dtype": dtype_name(self.dtype),
                "state": {n: [list(s), dtype_name(dt)] for n, s, dt in self.state}}


# ---- ids and the fingerprint ---------------------------------------------------------------------
def as_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` checked (a 1-d integer tensor) as int64 on the CPU."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise TypeError(f"ids: expected a 1-d integer tensor, got {getattr(ids, 'dtype', type(ids))} "
                        f"{list(getattr(ids, 'shape', []))}")
    return ids.to("cpu", torch.int64)


def jsonable(value: Any, name: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: must be JSON-able ({e})") from None


def differences(stored: Any, given: Any, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(given, dict):
        return [d for k in sorted(set(stored) | set(given), key=str)
                for d in differences(stored.get(k), given.get(k), f"{path}.{k}" if path else str(k))]
    return [] if stored == given else [f"{path or 'base'} (stored {stored!r}, given {given!r})"]


# ---- segments ------------------------------------------------------------------------------------------
def _pwrite(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_segment(directory: Path, serial: int, layout: Layout, n: int,
                  chunks: Iterable[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Write ``n`` rows as segment ``serial`` from ``chunks`` of ``(ids, {key: values})`` in order, and fsync it.
    Returns its manifest entry: ``{"file", "serial", "rows", "size", "crc32": {"header", "ids", "rows", ...}}``."""
    path = directory / segment_name(serial)
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    starts, offset = {}, 0
    for key, dt, shape in layout.file_parts:
        nbytes = n * dt.itemsize * math.prod(shape)
        header[key] = {"dtype": _ST_NAMES[dt], "shape": [n, *shape], "data_offsets": [offset, offset + nbytes]}
        starts[key], offset = offset, offset + nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head = struct.pack("<Q", len(blob) + (-len(blob) % 8)) + blob + b" " * (-len(blob) % 8)
    crcs = {"header": zlib.crc32(head)} | {key: 0 for key, _, _ in layout.file_parts}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, head, 0)
        done = 0
        for ids, values in chunks:
            k = ids.numel()
            for key, dt, shape in layout.file_parts:
                t = (ids if key == "ids" else values[key]).detach().to("cpu").contiguous()
                if t.dtype != dt or tuple(t.shape) != (k, *shape):
                    raise TypeError(f"{key}: {t.dtype} {list(t.shape)} given, expected {dt} {[k, *shape]}")
                if t.numel():
                    buf = bytes_of(t)
                    _pwrite(fd, buf, len(head) + starts[key] + done * dt.itemsize * math.prod(shape))
                    crcs[key] = zlib.crc32(buf, crcs[key])
            done += k
        if done != n:
            raise RuntimeError(f"{path}: {done} rows came, {n} were announced")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return {"file": path.name, "serial": serial, "rows": n, "size": len(head) + offset, "crc32": crcs}


class Segment:
    """A segment file mapped read only, with tensor views of its ``ids`` and fields (no copy).

    Opened from a manifest (``trusted=False``), its size, header and the checksums of its header and ids are
    checked at once (`check_head`), and those of its fields before any of its rows is read (`verify`).
    """

    def __init__(self, directory: Path, info: dict[str, Any], layout: Layout, serial: int, *,
                 durable: bool, trusted: bool) -> None:
        self.info, self.serial, self.durable, self.verified = info, serial, durable, trusted
        self.path = directory / info["file"]
        self.rows = int(info["rows"])
        self.size = int(info["size"])
        self.fences = torch.empty(0, dtype=torch.int64)   # every FENCE_EVERY-th id (set by the store)
        self.live = int(info.get("live", self.rows))     # rows no later segment replaces (the manifest's; else all)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ValueError(f"overlay: {self.path}, a file of the overlay's manifest, cannot be read ({e})") from None
        if size != self.size:
            raise ValueError(f"overlay: {self.path} is {size} bytes, its manifest says {self.size} (truncated or "
                             f"damaged)")
        if not trusted:                                  # the header's checksum, before it is parsed
            fd = os.open(self.path, os.O_RDONLY)
            try:
                n = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))[0]
                self._check_crc(fd, "header", 0, min(8 + n, size))
            finally:
                os.close(fd)
        try:
            self.file = MappedFile(self.path)
        except ValueError as e:
            raise ValueError(f"overlay: {self.path}: {e}") from None
        try:
            if not trusted:
                self.check_head()
            self.views: dict[str, torch.Tensor] = {}
            for key, dt, shape in layout.file_parts:
                try:
                    begin, _ = self.file.span(key, dt, (self.rows, *shape))
                except ValueError as e:
                    raise ValueError(f"overlay: {self.path} does not hold the rows its manifest describes ({e})") \
                        from None
                flat = map_view(self.file, begin, self.rows, math.prod(shape), dt)
                self.views[key] = flat.view(self.rows, *shape)
        except BaseException:
            self.close()
            raise

    @property
    def ids(self) -> torch.Tensor:
        return self.views["ids"]

    def _check_crc(self, fd: int, key: str, begin: int, end: int) -> None:
        crc, buf = 0, bytearray(min(_READ, max(end - begin, 0)))
        view = memoryview(buf)
        while begin < end:                               # one buffer reused: no heap freed and kept per read
            n = _pread_into(fd, view[: min(len(buf), end - begin)], begin)
            if not n:
                raise ValueError(f"overlay: {self.path} ends at byte {begin}, before its {key} (truncated)")
            crc, begin = zlib.crc32(view[:n], crc), begin + n
        if crc != int(self.info["crc32"][key]):
            raise ValueError(f"overlay: {self.path}: the bytes of its {key} do not match the checksum in the "
                             f"overlay's manifest (damaged or changed since written)")

    def _check(self, keys: Iterable[str]) -> None:
        self.check()
        for key in keys:
            if key == "header":
                begin, end = 0, self.file.data_start
            else:
                begin, end = (self.file.data_start + int(x) for x in self.file.header[key]["data_offsets"])
            self._check_crc(self.file.fd, key, begin, end)

    def check_head(self) -> None:
        """Check the checksums of the header and the ids (which the store's bitmap and fences are built from)."""
        self._check(["header", "ids"])

    def verify(self) -> None:
        """Check the checksums of the fields (the rows and their state), once."""
        if not self.verified:
            self._check([k for k in self.info["crc32"] if k not in ("header", "ids")])
            self.verified = True

    def check(self) -> None:
        """Raise ``ValueError`` (before any mapped read) if the file's size or mtime changed since it was mapped."""
        self.file.check("overlay")

    def close(self) -> None:
        self.views = {}
        if getattr(self, "file", None) is not None:
            self.file.close()


# ---- the manifest --------------------------------------------------------------------------------------
def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest's body, or ``None`` where the directory has none; a damaged one is a ``ValueError``."""
    path = directory / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
        body, crc = doc["manifest"], int(doc["crc32"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"overlay: {path} is not an overlay manifest ({e}); damaged?") from None
    if zlib.crc32(_canonical(body)) != crc:
        raise ValueError(f"overlay: {path} does not match its own checksum (damaged or edited)")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ValueError(f"overlay: {path} is format {body.get('format')!r} version {body.get('version')!r}; "
                         f"this library reads {FORMAT!r} version {VERSION}")
    return body


def write_manifest(directory: Path, body: dict[str, Any]) -> int:
    """Switch the directory to ``body`` atomically (a temporary file, fsync, rename, fsync of the directory).
    Returns the bytes written."""
    body = {"format": FORMAT, "version": VERSION} | body
    text = json.dumps({"crc32": zlib.crc32(_canonical(body)), "manifest": body}, indent=1).encode("utf-8")
    tmp = directory / (MANIFEST + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, text, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)
    return len(text)


def layout_of(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body.get(k) for k in ("dim", "dtype", "state")}


def parse_layout(body: dict[str, Any], path: Path) -> Layout:
    """The `Layout` a manifest describes (``ValueError`` naming ``path`` where it describes none)."""
    by_name = {dtype_name(dt): dt for dt in _ST_NAMES}
    try:
        state = {n: (tuple(s), by_name[dt]) for n, (s, dt) in body["state"].items()}
        return Layout.of(int(body["dim"]), by_name[body["dtype"]], state)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"overlay: {path} describes no row layout ({e!r}); damaged?") from None


def clean_leftovers(directory: Path, keep: set[str]) -> None:
    """Delete what a killed writer may have left: temporary files, and segments no manifest lists."""
    for p in directory.iterdir():
        if p.name.endswith(".tmp") or (_SEGMENT_RE.fullmatch(p.name) and p.name not in keep):
            p.unlink(missing_ok=True)
