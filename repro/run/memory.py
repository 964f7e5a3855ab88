"""GPU memory for case processes: what the GPUs have free (nvidia-smi: no CUDA in the parent), and a budget every
case holds its share of while its process runs, so that cases beside each other never ask for more than the GPU
has. Measured on the H200: `matrix --max-model-len 131072` at the default jobs put 8 of 16 cases in CUDA
out of memory (each allocates K and V caches of 16 GiB: max_num_seqs x max_model_len); fitted to the free memory
they run fewer at a time and every one gets its allocation. A case that alone needs more than the budget runs with
nothing beside it (whether it fits is its own check: AttnConfig.device_bytes refuses a shape no GPU holds)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator

GIB = 1 << 30
# What a case process holds beside its own tensors (the CUDA context, torch's and FA3's workspaces): on the H200 a
# case's context and workspaces took ~1.5 GiB (nvidia-smi per process); 2 GiB leaves slack.
PROCESS_OVERHEAD_BYTES = 2 * GIB
# Of the free memory at the start, the share left unbudgeted (other users of the GPU, fragmentation).
KEEP_FREE = 0.10


def gpu_memory_gib() -> list[tuple[float, float]]:
    """(total, free) GiB of every GPU nvidia-smi lists (no CUDA in this process); [] without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        try:
            total, free = (float(x) / 1024 for x in line.split(","))
        except ValueError:
            continue
        found.append((total, free))
    return found


class MemoryBudget:
    """Bytes of GPU memory the running cases may hold together. hold(n) waits until n more fit (or nothing else is
    held: a case larger than the whole budget runs alone), and gives them back when the case ends."""

    def __init__(self, total_bytes: int) -> None:
        self.total = max(1, int(total_bytes))
        self.held = 0
        self.worst = 0  # the most held at once (reports and tests)
        self._cond = threading.Condition()

    @classmethod
    def of_free_gpu(
        cls, memory: list[tuple[float, float]] | None = None, keep_of_total: float = 0.0
    ) -> MemoryBudget | None:
        """The emptiest GPU's free memory less KEEP_FREE of it, and less `keep_of_total` of its total where that is
        more (what each process must still find free when it starts: vLLM's gpu_memory_utilization check); None where
        no GPU memory is known (no limit)."""
        memory = gpu_memory_gib() if memory is None else memory
        if not memory:
            return None
        total, free = min(memory, key=lambda m: m[1])
        return cls(int(min(free * (1 - KEEP_FREE), free - keep_of_total * total) * GIB))

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        n = min(max(0, int(nbytes)), self.total)  # larger than the budget: waits until it holds all of it
        with self._cond:
            self._cond.wait_for(lambda: self.held + n <= self.total)
            self.held += n
            self.worst = max(self.worst, self.held)
        try:
            yield
        finally:
            with self._cond:
                self.held -= n
                self._cond.notify_all()


def case_bytes(device_bytes: int) -> int:
    """What one case process needs: its tensors (AttnConfig.device_bytes) and the process's own overhead."""
    return device_bytes + PROCESS_OVERHEAD_BYTES
