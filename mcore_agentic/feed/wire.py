"""What crosses the links between the trainer and the rollout ranks (``rollout.placement=separate``): tensors only.

Every message is an int64 header (tag 0) and the tensors it announces (tags 1..), on one link
(:mod:`mcore_agentic.parallel.job`): ``down`` from the trainer's rank 0 to an engine's rank, ``up`` back.

down (trainer -> each engine), in the order the trainer sends them:

==========  ===========================================  ======================================================
kind        header                                       then
==========  ===========================================  ======================================================
BUCKET      tensors, name bytes, data bytes, version     names (uint8, ``\\n``-joined), ``[tensors, 10]`` int64
                                                         (dtype code, ndim, shape), the data (uint8)
WEIGHTS     version                                      nothing: the version's buckets are all sent
WANT        step, trainer's weight version               nothing: the trainer waits for the step's rows
VALIDATE    step                                         nothing: the trainer waits for the validation's stats
DUMP        step, rows, fields, name bytes                the rows' response lengths (int64), the trainer's
                                                         per-token values (float32, row by row, field by field),
                                                         the field names: a dump step's return trip
SAVE        step, path bytes                             the checkpoint part's directory (utf-8): write what
                                                         this rank holds there, answer SAVED
RESTORE     step, path bytes                             the same: read it back (a resume), answer SAVED
STOP        —                                            nothing
==========  ===========================================  ======================================================

up (each engine -> trainer): ROWS (the step's scored rows as the exchange packs them: lengths, int64 and float32
buffers, the field set being the run's), VALIDATION (statistics only), SAVED or FAILED (the rollout rank's error line),
each with the statistics (:class:`~mcore_agentic.parallel.stats.Stats`: names, sums, counts, maxima, minima) and
the schedule's metrics (names, values).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.distribute import pack_rows
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.stats import Stats

BUCKET, WEIGHTS, WANT, VALIDATE, STOP, DUMP, SAVE, RESTORE = 1, 2, 3, 4, 5, 6, 7, 8
ROWS, VALIDATION, FAILED, SAVED = 11, 12, 13, 14
HEADER = 8
"""int64 values in a header (its kind first)."""
MAX_DIMS = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)


def _bytes(text: str) -> torch.Tensor:
    return comm.to_host(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else
                        torch.zeros(0, dtype=torch.uint8))


def _text(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode() if t.numel() else ""


def send_header(links: object, peer: int, kind: int, *values: int, up: bool) -> None:
    head = comm.host_zeros(HEADER, dtype=torch.long)
    head[0] = kind
    head[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.long)
    links.send(head, peer, 0, up=up)  # type: ignore[attr-defined]


def recv_header(links: object, peer: int, *, up: bool) -> list[int]:
    head = comm.host_zeros(HEADER, dtype=torch.long)
    links.recv(head, peer, 0, up=up)  # type: ignore[attr-defined]
    return head.tolist()


def _send(links: object, t: torch.Tensor, peer: int, tag: int, *, up: bool) -> None:
    if t.numel():
        links.send(comm.as_host(t.contiguous()), peer, tag, up=up)  # type: ignore[attr-defined]


def _recv(links: object, n: int, dtype: torch.dtype, peer: int, tag: int, *, up: bool) -> torch.Tensor:
    t = comm.host_empty(n, dtype=dtype)
    if n:
        links.recv(t, peer, tag, up=up)  # type: ignore[attr-defined]
    return t


# ----------------------------------------------------------------------------------- weights
def send_bucket(links: object, peer: int, bucket: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
    """One bucket of HF-named tensors to an engine's rank; returns the bytes sent."""
    names = "\n".join(name for name, _ in bucket)
    meta = torch.zeros(len(bucket), 2 + MAX_DIMS, dtype=torch.long)
    flats = []
    for i, (_, t) in enumerate(bucket):
        t = t.detach().to("cpu").contiguous()
        meta[i, 0], meta[i, 1] = DTYPES.index(t.dtype), t.dim()
        meta[i, 2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
        flats.append(t.reshape(-1).view(torch.uint8))
    data = torch.cat(flats) if flats else torch.zeros(0, dtype=torch.uint8)
    name_bytes = _bytes(names)
    send_header(links, peer, BUCKET, len(bucket), name_bytes.numel(), data.numel(), version, up=False)
    _send(links, name_bytes, peer, 1, up=False)
    _send(links, meta, peer, 2, up=False)
    _send(links, data, peer, 3, up=False)
    return int(data.numel())


def recv_bucket(links: object, header: Sequence[int]) -> list[tuple[str, torch.Tensor]]:
    """The bucket a BUCKET ``header`` announced (from the trainer), as ``(name, tensor)`` pairs."""
    n, name_bytes, data_bytes = header[1], header[2], header[3]
    names = _text(_recv(links, name_bytes, torch.uint8, 0, 1, up=False)).split("\n") if n else []
    meta = _recv(links, n * (2 + MAX_DIMS), torch.long, 0, 2, up=False).reshape(n, 2 + MAX_DIMS)
    data = _recv(links, data_bytes, torch.uint8, 0, 3, up=False)
    out, at = [], 0
    for i, name in enumerate(names):
        dtype, dims = DTYPES[int(meta[i, 0])], int(meta[i, 1])
        shape = [int(x) for x in meta[i, 2 : 2 + dims]]
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out.append((name, data[at : at + size].clone().view(dtype).reshape(shape)))  # its own, aligned storage
        at += size
    return out


def send_path(links: object, peer: int, kind: int, step: int, path: str) -> None:
    """A SAVE or RESTORE: the checkpoint part's directory."""
    text = _bytes(path)
    send_header(links, peer, kind, step, text.numel(), up=False)
    _send(links, text, peer, 1, up=False)


def recv_path(links: object, header: Sequence[int]) -> str:
    return _text(_recv(links, header[2], torch.uint8, 0, 1, up=False))


# ----------------------------------------------------------------------------------- a dump step's return trip
def send_returned(links: object, peer: int, step: int, returned: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """The trainer's per-token values of one engine's rows (``distribute.return_rows``' lists, per field) to it."""
    names = sorted(returned)
    rows = len(returned[names[0]]) if names else 0
    lengths = torch.tensor([len(returned[names[0]][i]) for i in range(rows)] if names else [], dtype=torch.long)
    values = [returned[f][i].float().reshape(-1) for i in range(rows) for f in names]
    flat = torch.cat(values) if values else torch.zeros(0)
    text = _bytes("\n".join(names))
    send_header(links, peer, DUMP, step, rows, len(names), text.numel(), up=False)
    _send(links, lengths, peer, 1, up=False)
    _send(links, flat, peer, 2, up=False)
    _send(links, text, peer, 3, up=False)


def recv_returned(links: object, header: Sequence[int]) -> dict[str, list[torch.Tensor]]:
    """What a DUMP ``header`` announced: per field, one tensor per row."""
    rows, fields, n_text = header[2], header[3], header[4]
    lengths = _recv(links, rows, torch.long, 0, 1, up=False).tolist()
    flat = _recv(links, sum(lengths) * fields, torch.float32, 0, 2, up=False)
    names = _text(_recv(links, n_text, torch.uint8, 0, 3, up=False)).split("\n") if fields else []
    out: dict[str, list[torch.Tensor]] = {f: [] for f in names}
    at = 0
    for n in lengths:
        for f in names:
            out[f].append(flat[at : at + n])
            at += n
    return out


# ----------------------------------------------------------------------------------- rows and statistics
@dataclass
class Reply:
    """What one engine's rank answered (up)."""

    kind: int
    step: int
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """ROWS: :func:`~.distribute.pack_rows`' (lengths, int64, float32)."""
    stats: Stats
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


def _stats_names(stats: Stats) -> list[str]:
    return sorted(stats.sums)


def send_reply(links: object, kind: int, step: int, *, rows: Batch | None = None, fields: Collection[str] = (),
               routing_shape: tuple[int, ...] | None = None, stats: Stats | None = None,
               metrics: Mapping[str, float] | None = None, error: str = "") -> None:
    """An engine's answer to the trainer (its link rank 0): rows, statistics and metrics, or an error line."""
    stats = stats or Stats()
    metrics = dict(metrics or {})
    parts = pack_rows(rows, fields, routing_shape) if rows is not None and len(rows) else None
    lengths, ints, floats = parts if parts is not None else (torch.zeros(0, 2, dtype=torch.long),
                                                             torch.zeros(0, dtype=torch.long),
                                                             torch.zeros(0, dtype=torch.float32))
    snames = _stats_names(stats)
    svalues = torch.tensor([[stats.sums[n], stats.counts[n], stats.maxs[n], stats.mins[n]] for n in snames],
                           dtype=torch.float64).reshape(-1)
    mnames = sorted(metrics)
    mvalues = torch.tensor([float(metrics[n]) for n in mnames], dtype=torch.float64)
    text = _bytes("\n".join([*snames, *mnames, *([error] if error else [])]))
    send_header(links, 0, kind, step, len(lengths), ints.numel(), floats.numel(), len(snames), len(mnames),
                text.numel(), up=True)
    _send(links, lengths.reshape(-1), 0, 1, up=True)
    _send(links, ints, 0, 2, up=True)
    _send(links, floats, 0, 3, up=True)
    _send(links, svalues, 0, 4, up=True)
    _send(links, mvalues, 0, 5, up=True)
    _send(links, text, 0, 6, up=True)


def recv_reply(links: object, peer: int) -> Reply:
    """One engine's answer (:func:`send_reply`)."""
    kind, step, n_rows, n_ints, n_floats, n_stats, n_metrics, n_text = recv_header(links, peer, up=True)
    lengths = _recv(links, 2 * n_rows, torch.long, peer, 1, up=True).reshape(n_rows, 2)
    ints = _recv(links, n_ints, torch.long, peer, 2, up=True)
    floats = _recv(links, n_floats, torch.float32, peer, 3, up=True)
    svalues = _recv(links, 4 * n_stats, torch.float64, peer, 4, up=True).reshape(n_stats, 4)
    mvalues = _recv(links, n_metrics, torch.float64, peer, 5, up=True)
    lines = _text(_recv(links, n_text, torch.uint8, peer, 6, up=True)).split("\n")
    stats = Stats()
    for i, name in enumerate(lines[:n_stats]):
        stats.sums[name], stats.counts[name] = float(svalues[i, 0]), float(svalues[i, 1])
        stats.maxs[name], stats.mins[name] = float(svalues[i, 2]), float(svalues[i, 3])
    metrics = {name: float(mvalues[i]) for i, name in enumerate(lines[n_stats : n_stats + n_metrics])}
    error = "\n".join(lines[n_stats + n_metrics :])
    parts = (lengths, ints, floats) if n_rows else None
    return Reply(kind, step, parts, stats, metrics, error)


__all__ = ["BUCKET", "DUMP", "FAILED", "RESTORE", "ROWS", "Reply", "SAVE", "SAVED", "STOP", "VALIDATE", "VALIDATION",
           "WANT", "WEIGHTS", "recv_bucket", "recv_header", "recv_path", "recv_reply", "recv_returned",
           "send_bucket", "send_header", "send_path", "send_reply", "send_returned"]
