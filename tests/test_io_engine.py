"""Byte round trips through both engine backends against os.urandom data, and the errors it raises."""

import os
import re
from pathlib import Path

import pytest
import torch

import zerolite
from support.helpers import greedy
from zerolite.io.engine import ALIGNMENT, HUGE_PAGE, IoEngine, ShortReadError, aligned_empty, host_bytes

BACKENDS = ["io_uring", "pread"]


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    """A 16 MiB + 4 KiB file of random bytes (not a power of two: the last chunk is partial)."""
    path = tmp_path_factory.mktemp("io") / "random.bin"
    data = os.urandom(16 * 2**20 + ALIGNMENT)
    path.write_bytes(data)
    return path, data


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_is_the_one_asked_for(backend):
    assert IoEngine(backend).backend == backend


def test_auto_picks_a_working_backend():
    assert IoEngine("auto").backend in BACKENDS


def test_aligned_empty_is_aligned():
    for nbytes in (0, 1, 4095, 4096, 12345, 2**20, HUGE_PAGE, 3 * HUGE_PAGE + 4096):
        buffer = aligned_empty(nbytes)
        assert buffer.nbytes == nbytes and buffer.dtype == torch.uint8
        assert buffer.data_ptr() % (HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGNMENT) == 0
        assert host_bytes(nbytes) >= nbytes


def huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping holding address, in KiB."""
    huge_kib, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if mapping := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(mapping[1], 16) <= address < int(mapping[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            huge_kib = int(line.split()[1])
    return huge_kib


def kernel_gives_huge_pages() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.is_file() and "[never]" not in thp.read_text()


def test_large_buffers_get_huge_pages_where_the_kernel_gives_them_unless_filled_once():
    """Reads into 4 KiB pages ran at 65% of the speed of reads into huge pages on the test VMs; a first
    read into fresh huge pages at a quarter of the speed of one into fresh 4 KiB pages."""
    again, once = aligned_empty(4 * HUGE_PAGE), aligned_empty(4 * HUGE_PAGE, huge_pages=False)
    again.fill_(1)
    once.fill_(1)
    assert huge_page_kib(once.data_ptr()) == 0
    if kernel_gives_huge_pages():
        assert huge_page_kib(again.data_ptr()) > 0, "the kernel allows transparent huge pages, and the buffer got none"


def test_a_cpu_model_fills_its_host_tier_and_resident_blocks_in_small_pages_and_reads_slots_in_huge_ones(make_layout):
    layout = make_layout(layers=4, hidden_size=512, intermediate_size=1024, vocab_size=2048)  # blocks above HUGE_PAGE
    with zerolite.load(layout, offload="nvme", cpu_memory="25MB", device="cpu", show_progress=False) as lm:
        executor = lm.executor
        tier = [buffer for name, buffer in executor.slots.memory._buffers.items() if name.startswith("layers.")]
        slots = [slot.host for slot in executor.slots._slots]
        assert tier and slots and lm.plan.resident
        greedy(lm, torch.tensor([[5, 17, 33, 9]]), 2, exact=True)  # the slots read into
        for buffer in tier:
            assert buffer.nbytes >= HUGE_PAGE and huge_page_kib(buffer.data_ptr()) == 0
        embedding = lm.model.get_input_embeddings().weight
        assert embedding.nbytes >= HUGE_PAGE and huge_page_kib(embedding.data_ptr()) == 0  # a resident block
        if kernel_gives_huge_pages():
            assert all(huge_page_kib(slot.data_ptr()) > 0 for slot in slots)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pages", [1, 2, 3, 255, 256, 257, 4095])
def test_aligned_reads_of_many_sizes_come_back_identical(random_file, backend, pages):
    path, data = random_file
    engine = IoEngine(backend, queue_depth=8, chunk_bytes=64 * 1024)
    nbytes = pages * ALIGNMENT
    for offset in (0, ALIGNMENT, len(data) - nbytes - ALIGNMENT):
        buffer = engine.read(path, aligned_empty(nbytes), file_offset=offset)
        assert as_bytes(buffer) == data[offset : offset + nbytes]


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_reads_in_flight_split_into_many_chunks(random_file, backend):
    path, data = random_file
    engine = IoEngine(backend, queue_depth=16, chunk_bytes=ALIGNMENT)
    spans = [(i * 37 % 4000 * ALIGNMENT, (i % 13 + 1) * 5 * ALIGNMENT) for i in range(64)]
    buffers = [aligned_empty(length) for _, length in spans]
    tickets = [engine.submit(path, b, offset) for b, (offset, _) in zip(buffers, spans)]
    for ticket in reversed(tickets):  # wait order is free
        engine.wait(ticket)
    for buffer, (offset, length) in zip(buffers, spans):
        assert as_bytes(buffer) == data[offset : offset + length]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cancelled_read_spares_what_had_not_started_and_is_still_waited_for(random_file, backend):
    """A read queued behind a long one, cancelled: none of it started (one read in flight at a
    time, the long one's 4 KiB chunks ahead), so all of it is spared and its buffer left as it
    was; the long read lands whole, a cancelled ticket is waited for as any, and a spent one is
    refused."""
    path, data = random_file
    engine = IoEngine(backend, queue_depth=1, chunk_bytes=ALIGNMENT, threads=1)
    first, second = aligned_empty(len(data) - ALIGNMENT), aligned_empty(64 * ALIGNMENT)
    second.fill_(7)
    long_read = engine.submit(path, first, 0)
    queued = engine.submit(path, second, 0)
    assert engine.cancel(queued) == second.numel()
    assert engine.cancel(queued) == 0  # nothing left to give up
    engine.wait(queued)
    engine.wait(long_read)
    assert as_bytes(first) == data[:first.numel()]
    assert bool((second == 7).all())
    with pytest.raises(ValueError, match="unknown ticket"):
        engine.cancel(queued)


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_file_in_one_request(random_file, backend):
    path, data = random_file
    engine = IoEngine(backend, queue_depth=4, chunk_bytes=2**20)
    assert as_bytes(engine.read(path, aligned_empty(len(data)))) == data


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_bytes_is_a_no_op(random_file, backend):
    engine = IoEngine(backend)
    engine.read(random_file[0], aligned_empty(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_misaligned_requests_are_refused(random_file, backend):
    path, _ = random_file
    engine = IoEngine(backend)
    with pytest.raises(ValueError, match="file offset must be a multiple of 4096"):
        engine.submit(path, aligned_empty(ALIGNMENT), file_offset=100)
    with pytest.raises(ValueError, match="length must be a multiple of 4096"):
        engine.submit(path, aligned_empty(1000))
    with pytest.raises(ValueError, match="destination address must be a multiple of 4096"):
        engine.submit(path, aligned_empty(2 * ALIGNMENT)[1 : ALIGNMENT + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_of_file_names_file_and_offset(random_file, backend):
    path, data = random_file
    engine = IoEngine(backend, chunk_bytes=ALIGNMENT)
    ticket = engine.submit(path, aligned_empty(4 * ALIGNMENT), file_offset=len(data) - ALIGNMENT)
    with pytest.raises(ShortReadError, match=f"ends at offset {len(data)}") as caught:
        engine.wait(ticket)
    assert caught.value.filename == str(path)
    with pytest.raises(ValueError, match="unknown ticket"):
        engine.wait(ticket)  # a failed ticket is spent


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_tail_is_a_short_read(tmp_path, backend):
    path = tmp_path / "odd.bin"
    path.write_bytes(os.urandom(3 * ALIGNMENT + 100))  # the file ends inside the last page
    engine = IoEngine(backend)
    with pytest.raises(ShortReadError, match="short read"):
        engine.read(path, aligned_empty(4 * ALIGNMENT))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file_raises_oserror_with_errno(tmp_path, backend):
    engine = IoEngine(backend)
    with pytest.raises(FileNotFoundError) as caught:
        engine.submit(tmp_path / "absent.bin", aligned_empty(ALIGNMENT))
    assert caught.value.filename == str(tmp_path / "absent.bin")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown I/O backend"):
        IoEngine("aio")
    with pytest.raises(ValueError, match="chunk_bytes"):
        IoEngine(chunk_bytes=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        IoEngine(queue_depth=0)


def test_reads_fall_back_to_buffered_where_o_direct_is_refused():
    """tmpfs has no O_DIRECT; the engine must still read there."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    data = os.urandom(8 * ALIGNMENT)
    path = f"/dev/shm/zerolite-test-{os.getpid()}.bin"
    try:
        with open(path, "wb") as f:
            f.write(data)
        for backend in BACKENDS:
            assert as_bytes(IoEngine(backend).read(path, aligned_empty(len(data)))) == data
    finally:
        os.unlink(path)
