"""Does the buffer-size growth of the gather come from TLB misses? Raw gather on 4 KiB vs 2 MiB pages.

Run: ``python benchmarks/huge_pages.py`` (``--quick``: seconds, figures meaningless). It copies 256 random
32-frame windows of a low-dim frame
(92 float32, the reference workload's payload) out of a 128-episode and a 4096-episode buffer, with the
cache warm (back-to-back calls) and flushed (twice the last-level cache streamed through it before each call),
from:

* ``torch shared memory``: ``share_memory_()``, what the engine uses (4 KiB pages);
* ``memfd + MADV_HUGEPAGE``: a ``memfd_create`` file mapped by torch and advised to use transparent huge
  pages. The kernel grants them only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows
  (``advise``, ``within_size``, ``always`` or ``force``); the script prints how many it got and changes no
  system setting itself.

If huge pages close the gap between the two buffer sizes, page walks are the cost; if not, it is the cache.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import ctypes
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from _timing import Table, last_level_cache_bytes, main_of, percentile, print_header, set_single_thread

MADV_HUGEPAGE = 14
STEPS, FLOATS, BATCH, CHUNK = 300, 92, 256, 32
SETTING = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


@dataclass(frozen=True)
class Args:
    """Raw gather on 4 KiB and huge pages, small and large buffer (about 30 s)."""

    quick: bool = False
    """Tiny buffers and few calls: checks that the script runs, figures are meaningless."""

    @property
    def sizes(self) -> tuple[int, int]:
        return (4, 16) if self.quick else (128, 4096)

    @property
    def rounds_and_calls(self) -> tuple[int, int]:
        return (1, 3) if self.quick else (8, 50)


def _shmem_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1])
    return 0


def _torch_shared(nbytes: int) -> tuple[torch.Tensor, int | None]:
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_(), None


def _memfd_huge(nbytes: int) -> tuple[torch.Tensor, int | None]:
    fd = os.memfd_create("simstream-huge-pages")
    os.ftruncate(fd, nbytes)
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
    libc = ctypes.CDLL(None, use_errno=True)
    # advise before the first touch, so page faults allocate huge pages where the kernel allows them
    if libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
        print(f"madvise(MADV_HUGEPAGE) refused: {os.strerror(ctypes.get_errno())} (4 KiB pages then)")
    return tensor, fd


class _Gather:
    """Random 32-frame windows of one buffer into a preallocated output, timed call by call."""

    def __init__(self, buffer: torch.Tensor, episodes: int) -> None:
        frames = buffer.view(torch.float32).view(episodes * STEPS, FLOATS)
        self.windows = frames.as_strided((frames.shape[0] - CHUNK + 1, CHUNK, FLOATS), (FLOATS, FLOATS, 1))
        self.out = torch.empty(BATCH, CHUNK, FLOATS)
        self.episodes = episodes
        self.generator = torch.Generator().manual_seed(0)
        self.durations: dict[bool, list[float]] = {False: [], True: []}

    def run(self, calls: int, flush: bool, scratch: torch.Tensor, sink: torch.Tensor) -> None:
        for _ in range(calls):
            rows = torch.randint(0, self.episodes, (BATCH,), generator=self.generator)
            starts = rows * STEPS + torch.randint(0, STEPS - CHUNK + 1, (BATCH,), generator=self.generator)
            if flush:
                sink.copy_(scratch)
            began = time.perf_counter()
            torch.index_select(self.windows, 0, starts, out=self.out)
            self.durations[flush].append(time.perf_counter() - began)

    def median_ms(self, flush: bool) -> float:
        return percentile(self.durations[flush], 50) * 1e3


def run(args: Args) -> int:
    set_single_thread()
    rounds, calls = args.rounds_and_calls
    setting = SETTING.read_text().strip() if SETTING.exists() else "unknown"
    print_header(
        "huge pages and buffer size",
        ["python", "benchmarks/huge_pages.py", *sys.argv[1:]],
        f"shmem_enabled: {setting}; {rounds} interleaved rounds of {calls} calls per buffer, median shown"
        + (" (QUICK: figures meaningless)" if args.quick else ""),
    )
    gathers: dict[tuple[str, int], _Gather] = {}
    obtained: dict[str, int] = {}
    fds = []
    for label, allocate in (("torch shared memory", _torch_shared), ("memfd + MADV_HUGEPAGE", _memfd_huge)):
        before = _shmem_huge_kib()
        for episodes in args.sizes:
            buffer, fd = allocate(episodes * STEPS * FLOATS * 4)
            fds += [fd] if fd is not None else []
            buffer.fill_(1)
            gathers[label, episodes] = _Gather(buffer, episodes)
        obtained[label] = _shmem_huge_kib() - before
    # twice the last-level cache (64 MiB where it is unknown): 64 MiB left machine B's 105 MiB cache warm
    scratch = torch.ones(2 * (last_level_cache_bytes() or 32 * 2**20) // 4)
    sink = torch.empty_like(scratch)
    try:
        for _ in range(rounds):
            for flush in (False, True):
                for gather in gathers.values():
                    gather.run(calls, flush, scratch, sink)
    finally:
        for fd in fds:
            os.close(fd)
    low, high = args.sizes
    table = Table(
        "Raw gather of 256 x 32 low-dim windows, ms per batch",
        ["memory", "huge pages"] + [f"{n} {c}" for c in ("warm", "cold") for n in (low, high, "growth")],
    )
    for label in obtained:
        small, large = gathers[label, low], gathers[label, high]
        row = [label, f"{obtained[label] // 1024} MiB"]
        for flush in (False, True):
            small_ms, large_ms = small.median_ms(flush), large.median_ms(flush)
            row += [small_ms, large_ms, f"{large_ms / small_ms - 1:+.0%}"]
        table.row(*row)
    return 0


if __name__ == "__main__":
    main_of(run, Args)
