"""Moving a stage's state from one replica to another without holding it twice.

The wire format is hivemind's state download (``rpc_download_state``): each tensor is streamed as parts, the
first naming its dtype, shape and codec, the next ones carrying bytes only; the first message also carries the
metadata. A joining replica's state is parameters plus two AdamW moments per parameter: gigabytes for a large
stage, so neither side ever builds a second whole copy.

- Serving (the averager's process): :func:`stream_state` cuts each tensor into parts straight from its memory,
  one part at a time (hivemind serialises each tensor whole, then copies it into parts).
- Receiving (the averager's process): :func:`receive_state` checks each part and writes its bytes at their
  place in a file (:class:`StateWriter`) as it arrives; nothing is decoded or kept in memory.
- Handing over (the peer's process): a :class:`StateFile` is an unnamed temporary file the peer creates and the
  averager's process writes into (its descriptor crosses the process pipe, not the bytes); the peer maps it and
  gets the tensors as views of it. The file lives as long as those tensors: the kernel may write its pages back
  to disk and drop them under memory pressure, unlike anonymous memory.

Only uncompressed parts are accepted: they can be written where they belong as they come. Our replicas serve
uncompressed states (hivemind's default for state downloads).
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from multiprocessing.reduction import DupFd
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout

__all__ = [
    "TransferError",
    "TensorSlot",
    "StateFile",
    "StateWriter",
    "receive_state",
    "stream_state",
    "STATE_CHUNK_BYTES",
    "SLOT_BYTES",
]

STATE_CHUNK_BYTES = 2**20  # bytes of one tensor part sent (p2pd carries up to 4 MiB per message)
ALIGNMENT = 64  # each tensor starts at a multiple of this in the file, so any dtype can view it
SLOT_BYTES = ALIGNMENT  # what each tensor counts toward a download's max_bytes besides its bytes: an empty one too
DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
}


class TransferError(ValueError):
    """A state stream that is not a well-formed state, or a state that cannot be sent as one."""


class TensorSlot(NamedTuple):
    """Where one received tensor lies in a :class:`StateFile`: what the averager's process hands the peer's."""

    offset: int  # bytes from the file's start
    dtype: str  # a key of DTYPES
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


# ---- serving ----


def stream_state(
    metadata: bytes, tensors: Sequence[torch.Tensor], chunk_bytes: int = STATE_CHUNK_BYTES
) -> Iterator[averaging_pb2.DownloadData]:
    """The messages of a state download: every tensor in parts of ``chunk_bytes``, ``metadata`` with the first."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    first: Optional[bytes] = metadata
    for tensor in tensors:
        for part in _tensor_parts(tensor, chunk_bytes):
            if first is None:
                yield averaging_pb2.DownloadData(tensor_part=part)
            else:
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=first)
                first = None


def _tensor_parts(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[runtime_pb2.Tensor]:
    """One tensor's parts, each copied out of the tensor's memory when it is sent (bfloat16 as its raw 2 bytes,
    which hivemind's receiver reads too)."""
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise TransferError(f"a state tensor of dtype {tensor.dtype} cannot be sent")
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    yield runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE,
        buffer=data[:chunk_bytes].tobytes(),
        chunks=math.ceil(len(data) / chunk_bytes),
        size=tuple(tensor.shape),
        dtype=dtype,
        requires_grad=tensor.requires_grad,
    )
    for start in range(chunk_bytes, len(data), chunk_bytes):
        yield runtime_pb2.Tensor(buffer=data[start : start + chunk_bytes].tobytes())


# ---- receiving: in the averager's process ----


class StateWriter:
    """Writes the tensors of one state stream, part by part, into a file; runs in the averager's process.

    Every part is checked before its bytes are written: a tensor's first part must be uncompressed and name a
    known dtype, and a tensor takes exactly the bytes its shape holds. Writes only ever follow
    bytes received, so the file never outgrows what the sender sent. Owns (and closes) the descriptor ``fd``."""

    def __init__(self, fd: int):
        self._fd = fd
        try:
            self.reset()
        except BaseException:
            self.close()
            raise

    def reset(self) -> None:
        """Start over (the next source's stream): drop whatever the file holds."""
        os.ftruncate(self._fd, 0)
        self._slots: List[TensorSlot] = []
        self._written = 0  # bytes of the last slot received so far
        self._end = 0  # where the next tensor may start

    def add(self, part: runtime_pb2.Tensor) -> None:
        if part.dtype:  # a part naming its dtype starts the next tensor
            self._close_slot()
            self._slots.append(self._open_slot(part))
        elif not self._slots:
            raise TransferError("a state part continues no tensor")
        slot, data = self._slots[-1], part.buffer
        if self._written + len(data) > slot.nbytes:
            raise TransferError(
                f"state tensor {len(self._slots) - 1} sent more than the {slot.nbytes} bytes "
                f"its shape {list(slot.shape)} holds"
            )
        self._write(data, slot.offset + self._written)
        self._written += len(data)

    def finish(self) -> List[TensorSlot]:
        """Where the state's tensors lie in the file, once the stream ended."""
        self._close_slot()
        return list(self._slots)

    def _open_slot(self, part: runtime_pb2.Tensor) -> TensorSlot:
        index = len(self._slots)
        if part.compression != runtime_pb2.CompressionType.NONE:
            codec = (
                runtime_pb2.CompressionType.Name(part.compression)
                if part.compression in runtime_pb2.CompressionType.values()
                else str(part.compression)
            )
            raise TransferError(f"state tensor {index} is compressed ({codec}): states travel uncompressed")
        if part.dtype not in DTYPES:
            raise TransferError(f"state tensor {index} has dtype {part.dtype[:32]!r}, not one of {sorted(DTYPES)}")
        offset = -(-self._end // ALIGNMENT) * ALIGNMENT
        self._written = 0
        return TensorSlot(offset, part.dtype, tuple(int(size) for size in part.size))

    def _close_slot(self) -> None:
        if self._slots and self._written != self._slots[-1].nbytes:
            slot = self._slots[-1]
            raise TransferError(
                f"state tensor {len(self._slots) - 1} ended after {self._written} of {slot.nbytes} bytes"
            )
        if self._slots:
            self._end = self._slots[-1].offset + self._slots[-1].nbytes

    def _write(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "StateWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def receive_state(
    stream: AsyncIterator[averaging_pb2.DownloadData],
    writer: StateWriter,
    part_timeout: Optional[float],
    max_bytes: Optional[int],
    called_off: Callable[[], bool] = lambda: False,
) -> Optional[Tuple[bytes, List[TensorSlot]]]:
    """(serialized metadata, where each tensor lies) of one source's stream, written by ``writer``; None if
    the stream carried no metadata (the source does not share its state, or refused us).

    A part that takes longer than ``part_timeout`` to come ends the download (``asyncio.TimeoutError``), and so
    does a stream over ``max_bytes`` (its parts' bytes and metadata, plus ``SLOT_BYTES`` per tensor) or a
    malformed one (:class:`TransferError`), or ``called_off()`` turning true (the caller stopped waiting)."""
    writer.reset()
    metadata, received = None, 0
    async for message in aiter_with_timeout(stream, part_timeout):
        if called_off():
            raise TransferError("the download was called off")
        part = message.tensor_part
        received += len(part.buffer) + len(message.metadata) + (SLOT_BYTES if part.dtype else 0)
        if max_bytes is not None and received > max_bytes:
            raise TransferError(f"the state exceeds {max_bytes} bytes")
        if message.metadata:
            metadata = message.metadata
        writer.add(part)
    slots = writer.finish()
    return None if metadata is None else (metadata, slots)


# ---- handing over: in the peer's process ----


class StateFile:
    """An unnamed temporary file for one download, in ``directory`` (None: the system's temporary directory,
    ``TMPDIR``): created by the peer's process, written by its averager's process, mapped by the peer's.

    It never has a name, so nothing is left behind whichever process dies: its space goes once every descriptor
    is closed and every tensor viewing it is gone."""

    def __init__(self, directory: Optional[str] = None):
        self._file = tempfile.TemporaryFile(dir=directory)

    def fileno(self) -> int:
        return self._file.fileno()

    def handle(self) -> Any:
        """What to send the averager's process through its pipe: there, ``handle.detach()`` is a descriptor of
        this file (passed over a Unix socket by multiprocessing's resource sharer)."""
        return DupFd(self.fileno())

    def tensors(self, slots: Sequence[TensorSlot]) -> List[torch.Tensor]:
        """The tensors at ``slots``, as views of the file mapped copy-on-write (writing to one never changes
        the file). The mapping lasts as long as any of them."""
        slots = [TensorSlot(*slot) for slot in slots]
        size = os.fstat(self.fileno()).st_size
        end = max((slot.offset + slot.nbytes for slot in slots), default=0)
        if end > size:
            raise TransferError(f"a received tensor ends at byte {end}, past the end of the state's file ({size})")
        mapped = mmap.mmap(self.fileno(), end, access=mmap.ACCESS_COPY) if end else None
        return [
            torch.empty(slot.shape, dtype=DTYPES[slot.dtype])
            if slot.numel == 0
            else torch.frombuffer(mapped, dtype=DTYPES[slot.dtype], count=slot.numel, offset=slot.offset).view(
                slot.shape
            )
            for slot in slots
        ]

    def close(self) -> None:
        """Close the peer's descriptor; tensors already mapped stay valid."""
        self._file.close()
