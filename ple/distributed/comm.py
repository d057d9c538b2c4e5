"""`Comm`: every transport call `ple.distributed` makes, on one `torch.distributed` group, with byte counts.

Nothing here is home-made transport: point-to-point messages go through
``dist.batch_isend_irecv`` and the collectives are ``all_gather_single`` /
``all_reduce`` / ``reduce_scatter_single`` / ``all_to_all_single`` of the group's backend (NCCL on GPUs,
gloo on CPUs). `Comm` only wraps them so each call is counted.

Bytes are counted per rank, under a category name (``"conv_halo"``,
``"conv_allgather"``, ...), as what this rank puts on the wire:

* point to point: exactly the bytes of the tensors it sends;
* ``all_gather`` of an ``n``-byte chunk: ``(W - 1) * n`` (its chunk reaches every other rank);
* ``all_reduce`` of ``n`` bytes: ``2 * (W - 1) / W * n`` (ring reduce-scatter + all-gather);
* ``reduce_scatter`` of ``n`` bytes in: ``(W - 1) / W * n``;
* ``all_to_all``: exactly the bytes of the rows it sends to other ranks.

The collective counts are those of the bandwidth-optimal ring algorithms NCCL and
gloo use for large messages; what a backend does for tiny ones may differ.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Comm", "as_comm"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """The transport of one process group (``None``: the default group), counting bytes sent.

    ``bytes_sent[category]`` and ``calls[category]`` accumulate over this object's
    life; ``reset()`` clears them. Every rank of the group must make the same
    sequence of collective calls; point-to-point ``exchange`` calls must be matched
    by the peers named in them.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ple.distributed needs torch.distributed initialised "
                               "(dist.init_process_group) before a Comm is made")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.bytes_sent: Counter = Counter()
        self.calls: Counter = Counter()
        self.backend = str(dist.get_backend(group))
        # NCCL needs every rank in the group's first call, so a batch of messages between some
        # ranks only must not come first: one collective warms the communicator up.
        self._p2p_ready = "nccl" not in self.backend

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, bytes_sent={dict(self.bytes_sent)})"

    @property
    def mesh(self) -> DeviceMesh:
        """This group as a 1-D ``DeviceMesh`` (made once), for DTensor collectives on the same ranks."""
        if getattr(self, "_mesh", None) is None:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None, "torch.distributed is not initialised"
            self._mesh = DeviceMesh.from_group(group, "cuda" if "nccl" in self.backend else "cpu")
        return self._mesh

    def count(self, category: str, nbytes: float) -> None:
        """Count ``nbytes`` sent under ``category`` (for collectives issued elsewhere, e.g. by DTensor)."""
        self._count(category, nbytes)

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()

    def _count(self, category: str, nbytes: float) -> None:
        self.bytes_sent[category] += int(round(nbytes))
        self.calls[category] += 1

    # ---- point to point ------------------------------------------------------------------------
    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 category: str) -> None:
        """Send and receive in one batch: ``sends`` and ``recvs`` are lists of ``(peer, tensor)``.

        Peers are ranks within the group. Receive tensors are filled in place and must
        be contiguous. Returns when every message of this rank has completed. Every
        rank of the group makes the call, with or without messages of its own.
        """
        if not self._p2p_ready:
            self.all_reduce(torch.zeros(1, device="cuda"), "control")
            self._p2p_ready = True
        ops = []
        nbytes = 0
        for peer, t in sends:
            t = t.contiguous()
            ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=peer))
            nbytes += _nbytes(t)
        for peer, t in recvs:
            if not t.is_contiguous():
                raise ValueError("recvs: receive buffers must be contiguous")
            ops.append(dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self._count(category, nbytes)

    # ---- collectives ---------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, category: str) -> torch.Tensor:
        """Every rank's ``x`` (same shape on every rank), stacked: ``[W, *x.shape]``."""
        x = x.contiguous()
        flat = x.reshape(1, -1) if x.dim() == 0 else x
        out = flat.new_empty((self.world_size * flat.shape[0], *flat.shape[1:]))
        _all_gather_single(out, flat, group=self.group)
        self._count(category, (self.world_size - 1) * _nbytes(x))
        return out.reshape(self.world_size, *x.shape)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int], category: str) -> torch.Tensor:
        """Rows of every rank, concatenated in rank order: rank r holds ``counts[r]`` rows of ``x``.

        Collectives need equal sizes, so every chunk is padded to ``max(counts)`` rows
        (the padding is sent and counted).
        """
        if x.shape[0] != counts[self.rank]:
            raise ValueError(f"x: rank {self.rank} should hold {counts[self.rank]} rows, got {x.shape[0]}")
        m = max(counts) if counts else 0
        padded = x.new_zeros((m, *x.shape[1:]))
        padded[: x.shape[0]] = x
        stacked = self.all_gather(padded, category)                 # [W, m, ...]
        return torch.cat([stacked[r, :n] for r, n in enumerate(counts)], dim=0)

    def all_reduce(self, x: torch.Tensor, category: str) -> torch.Tensor:
        """Sum of every rank's ``x``, in place (``x`` must be contiguous); returns ``x``."""
        dist.all_reduce(x, group=self.group)
        W = self.world_size
        self._count(category, 2 * (W - 1) / W * _nbytes(x))
        return x

    def reduce_scatter(self, x: torch.Tensor, category: str) -> torch.Tensor:
        """``x`` is ``[W * n, ...]``; returns this rank's ``[n, ...]`` block of the sum over ranks."""
        W = self.world_size
        if x.shape[0] % W:
            raise ValueError(f"x: expected a multiple of world_size={W} rows, got {x.shape[0]}")
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // W, *x.shape[1:]))
        _reduce_scatter_single(out, x, group=self.group)
        self._count(category, (W - 1) / W * _nbytes(x))
        return out

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], category: str) -> torch.Tensor:
        """Rows of ``x`` to every rank: the first ``send_rows[0]`` to rank 0, the next ``send_rows[1]`` to rank 1,
        ...; returns what the ranks sent here, concatenated in rank order (``recv_rows[r]`` rows from rank r).
        Counts the rows sent to other ranks (those kept by this rank cross no wire)."""
        x = x.contiguous()
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        dist.all_to_all_single(out, x, recv_rows, send_rows, group=self.group)
        row = _nbytes(x[:1]) if x.shape[0] else 0
        self._count(category, (sum(send_rows) - send_rows[self.rank]) * row)
        return out

    def all_reduce_sum_ints(self, values: list[int], category: str = "control") -> list[int]:
        """Sum small lists of Python ints across ranks (int64, on the CPU for gloo or the current GPU)."""
        dev = "cuda" if "nccl" in self.backend else "cpu"
        t = torch.tensor(values, dtype=torch.int64, device=dev)
        return self.all_reduce(t, category).tolist()


GroupLike = Comm | dist.ProcessGroup | DeviceMesh | None
"""What the ``group=`` arguments take: a `Comm`, a process group, a 1-D ``DeviceMesh``, or None (the default group)."""


def as_comm(group: GroupLike) -> Comm:
    """A `Comm` for ``group``: a `Comm` is returned as is; a process group (``None``: the default one) or a 1-D
    ``DeviceMesh`` (its group) is wrapped."""
    if isinstance(group, Comm):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: expected a 1-D DeviceMesh, got {group.ndim} dimensions")
        group = group.get_group()
    return Comm(group)
