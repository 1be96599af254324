"""A joiner downloads a stage's state in memory bounded by the state's size, bit for bit.

A replica serves a ~200 MB state laid out as :meth:`StageRunner.state_tensors` lays it out (parameters,
two AdamW moments per parameter, the step count); another replica's averager downloads it, both on loopback
in this process. The downloading side (this process and its averager's process) must not grow by more than
1.3 times the state: parts go into a file as they arrive, and the tensors this process gets are views of it.
The serving averager allocates no more than a part at a time. The stream's decoding and its refusals are
checked without a network below.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
from hivemind import DHT
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming

from swarm.server.averaging import StageAverager
from swarm.server.state_transfer import StateFile, StateWriter, TensorSlot, TransferError, receive_state, stream_state

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PREFIX = "state_download_test_stage0"
SEED = 20240611
PARAM_SHAPES: Tuple[Tuple[int, ...], ...] = ((2048, 4096), (4096, 2048), (4096,))
METADATA = {"stage": 0, "step": 12, "samples_applied": 96}
MAX_GROWTH = 1.3  # of the state's bytes: what the downloading processes may grow by at their peak
MAX_SERVING_GROWTH = 0.1  # of the state's bytes: what the serving averager may allocate to stream it (parts only)


# ---- the served state, and the two replicas ----


def state_shapes() -> List[Tuple[int, ...]]:
    """The runner's layout: parameters, then (exp_avg, exp_avg_sq) of each parameter, then the step count."""
    return [*PARAM_SHAPES, *(shape for shape in PARAM_SHAPES for _ in range(2)), (1,)]


def state_tensor(index: int) -> torch.Tensor:
    shapes = state_shapes()
    if index == len(shapes) - 1:
        return torch.tensor([float(METADATA["step"])])
    tensor = torch.randn(shapes[index], generator=torch.Generator().manual_seed(SEED + index))
    moment = index - len(PARAM_SHAPES)
    return tensor if moment < 0 else (tensor * 1e-3 if moment % 2 == 0 else tensor.square() * 1e-6)


def state_bytes() -> int:
    return sum(4 * torch.Size(shape).numel() for shape in state_shapes())


class Replicas:
    """Two DHT nodes on loopback, each with a stage averager: ``server`` shares the state, ``downloader`` fetches it.

    The served tensors are in shared memory from the start, so that handing them to the server's averager process
    copies nothing in this process (which is also the downloading peer)."""

    def __init__(self):
        self.served = [state_tensor(i).share_memory_() for i in range(len(state_shapes()))]
        self.dhts: List[DHT] = []
        self.averagers: List[StageAverager] = []
        try:
            self.dhts.append(DHT(host_maddrs=LOOPBACK, start=True))
            self.server = self._averager(self.dhts[0], lambda: (dict(METADATA), self.served), share=True)
            maddrs = [str(a) for a in self.dhts[0].get_visible_maddrs()]
            self.dhts.append(DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=True))
            self.downloader = self._averager(self.dhts[1], lambda: ({}, []), share=False)
        except BaseException:
            self.close()
            raise

    def _averager(self, dht: DHT, state_fn, share: bool) -> StageAverager:
        self.averagers.append(StageAverager([torch.zeros(4)], state_fn, dht=dht, start=True, prefix=PREFIX,
                                            allow_state_sharing=share, request_timeout=1.0, next_chunk_timeout=20.0,
                                            initial_group_bits="0" * 16))
        return self.averagers[-1]

    @property
    def server_id(self) -> str:
        return str(self.dhts[0].peer_id)

    @property
    def downloader_id(self) -> str:
        return str(self.dhts[1].peer_id)

    def close(self) -> None:
        for item in [*reversed(self.averagers), *reversed(self.dhts)]:
            if item.is_alive():
                item.shutdown()


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    replicas = Replicas()
    try:
        yield replicas
    finally:
        replicas.close()


# ---- what the processes hold ----


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {field}")


class PeakMemory:
    """The peak growth, in bytes, of what the processes ``pids`` hold while the ``with`` block runs.

    ``peak_rss``: the sum over the processes of each one's peak resident set (the kernel's VmHWM, reset on
    entry) less its resident set on entry: exact, and an upper bound (each process's peak counts, whenever
    it came, and a page two of them map counts twice). ``sampled_rss``: the peak of the sum of their resident
    sets, sampled every ``period`` seconds by a thread. ``sampled_anon``: the same for the anonymous memory of
    ``anon_pid``, another process to watch."""

    def __init__(self, pids: Sequence[int], anon_pid: int, period: float = 0.005):
        self.pids, self.anon_pid, self.period = list(pids), anon_pid, period
        self.peak_rss = self.sampled_rss = self.sampled_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "PeakMemory":
        for pid in self.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # VmHWM := VmRSS
        self._rss0 = {pid: _status_kb(pid, "VmRSS") for pid in self.pids}
        self._thread.start()
        return self

    def _sample(self) -> None:
        rss0, anon0 = sum(self._rss0.values()), _status_kb(self.anon_pid, "RssAnon")
        peak_rss = peak_anon = 0
        while not self._stop.wait(self.period):
            peak_rss = max(peak_rss, sum(_status_kb(pid, "VmRSS") for pid in self.pids) - rss0)
            peak_anon = max(peak_anon, _status_kb(self.anon_pid, "RssAnon") - anon0)
        self.sampled_rss, self.sampled_anon = 1024 * peak_rss, 1024 * peak_anon

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = 1024 * sum(_status_kb(pid, "VmHWM") - self._rss0[pid] for pid in self.pids)


def read_everything(tensors: Sequence[torch.Tensor]) -> None:
    """Read every byte of ``tensors`` where it lies, as a joiner reads a state to check it."""
    for tensor in tensors:
        hashlib.blake2b(tensor.contiguous().view(-1).view(torch.uint8).numpy())


async def test_a_200_mb_state_downloads_bit_for_bit_within_1_3_times_its_size(replicas):
    """Asked first, the downloader itself sends nothing (it does not share its state): the server is asked next."""
    size = state_bytes()
    with PeakMemory([os.getpid(), replicas.downloader.pid], anon_pid=replicas.server.pid) as memory:
        started = time.monotonic()
        downloaded = await replicas.downloader.load_state_from([replicas.downloader_id, replicas.server_id],
                                                               timeout=50.0, max_bytes=2 * size + 2**20, wait=False)
        took = time.monotonic() - started
        assert downloaded is not None, "the download failed"
        source, metadata, tensors = downloaded
        read_everything(tensors)
    report = {"state_mb": round(size / 2**20, 1), "download_s": round(took, 1), **{
        name: round(getattr(memory, name) / size, 3) for name in ("peak_rss", "sampled_rss")},
        "serving_averager_anon": round(memory.sampled_anon / size, 3)}
    print(f"\nstate download, growth in state sizes: {json.dumps(report)}")
    assert source == replicas.server_id and metadata == METADATA
    assert [tuple(t.shape) for t in tensors] == state_shapes() and all(t.dtype == torch.float32 for t in tensors)
    for index, (got, served) in enumerate(zip(tensors, replicas.served)):
        assert torch.equal(got.view(torch.int32), served.view(torch.int32)), f"tensor {index} differs"
    assert memory.peak_rss <= MAX_GROWTH * size, (
        f"the downloading processes grew by {memory.peak_rss / size:.2f}x the state's size at their peak")
    assert memory.sampled_anon <= MAX_SERVING_GROWTH * size, (
        f"the serving averager allocated {memory.sampled_anon / size:.2f}x the state's size to stream it")


def test_a_state_over_max_bytes_is_refused(replicas):
    started = time.monotonic()
    assert replicas.downloader.load_state_from([replicas.server_id], timeout=50.0, max_bytes=2**20) is None
    assert time.monotonic() - started < 20.0, "the oversized stream was not cut off early"


# ---- the stream without a network: what a server sends, what a receiver accepts ----


def sample_state() -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(300, 700, generator=generator), torch.randn(5, generator=generator).to(torch.bfloat16),
            torch.tensor(7, dtype=torch.int64), torch.zeros(0, 3), torch.rand(40, generator=generator) > 0.5,
            torch.randn(17, generator=generator, dtype=torch.float64)]


def receive(messages: Sequence[averaging_pb2.DownloadData], directory: Path,
            max_bytes: Optional[int] = None) -> Optional[Tuple[bytes, List[torch.Tensor]]]:
    """What the averager's process and then the peer's make of ``messages``, without the network between."""
    async def stream() -> AsyncIterator[averaging_pb2.DownloadData]:
        for message in messages:
            yield message

    state_file = StateFile(str(directory))
    try:
        with StateWriter(os.dup(state_file.fileno())) as writer:
            received = asyncio.run(receive_state(stream(), writer, part_timeout=5.0, max_bytes=max_bytes))
        return None if received is None else (received[0], state_file.tensors(received[1]))
    finally:
        state_file.close()


def test_streamed_state_decodes_bit_for_bit_in_small_parts(tmp_path):
    tensors = sample_state()
    messages = list(stream_state(b"meta", tensors, chunk_bytes=1000))
    assert messages[0].metadata == b"meta" and not any(m.metadata for m in messages[1:])
    assert max(len(m.tensor_part.buffer) for m in messages) == 1000
    metadata, received = receive(messages, tmp_path)
    assert metadata == b"meta" and len(received) == len(tensors)
    for sent, got in zip(tensors, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))
    assert list(tmp_path.iterdir()) == [], "the state's file has a name"


def test_hivemind_decodes_the_streamed_state(tmp_path):
    """A downloader running hivemind's own code (``load_state_from_peers`` of another averager) reads it too."""
    tensors = sample_state()
    parts: List[List[runtime_pb2.Tensor]] = []
    for message in stream_state(b"meta", tensors, chunk_bytes=4096):
        if message.tensor_part.dtype:
            parts.append([])
        parts[-1].append(message.tensor_part)
    decoded = [deserialize_torch_tensor(combine_from_streaming(p)) for p in parts]
    assert all(torch.equal(d, t) for d, t in zip(decoded, tensors))


def part(dtype: str = "float32", size: Sequence[int] = (2,), buffer: bytes = b"\0" * 8,
         compression: int = runtime_pb2.CompressionType.NONE) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(
        dtype=dtype, size=list(size), buffer=buffer, compression=compression))


def continuation(buffer: bytes) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=buffer))


@pytest.mark.parametrize("messages, error", [
    ([continuation(b"\0" * 8)], "continues no tensor"),
    ([part(buffer=b"\0" * 4)], "ended after 4 of 8 bytes"),
    ([part(buffer=b"\0" * 4), continuation(b"\0" * 8)], "more than the 8 bytes"),
    ([part(compression=runtime_pb2.CompressionType.FLOAT16)], "compressed"),
    ([part(dtype="complex64")], "dtype"),
    ([part(buffer=b"\0" * 4), part()], "ended after 4 of 8 bytes"),
], ids=["orphan-part", "cut-short", "overlong", "compressed", "dtype", "cut-by-next"])
def test_a_malformed_stream_is_refused(messages, error, tmp_path):
    with pytest.raises(TransferError, match=error):
        receive(messages, tmp_path)


def test_every_tensor_counts_toward_max_bytes(tmp_path):
    """Empty tensors carry no bytes; each still counts, so an endless stream of them is cut off."""
    with pytest.raises(TransferError, match="exceeds 100000 bytes"):
        receive([part(size=(0,), buffer=b"")] * 10_000, tmp_path, max_bytes=100_000)
    assert receive([part(size=(0,), buffer=b"")] * 10, tmp_path, max_bytes=100_000) is None  # no metadata: no state


def test_a_state_file_refuses_slots_past_its_end(tmp_path):
    state_file = StateFile(str(tmp_path))
    try:
        with pytest.raises(TransferError, match="past the end"):
            state_file.tensors([TensorSlot(0, "float32", (4,))])
    finally:
        state_file.close()
