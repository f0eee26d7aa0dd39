"""The one place that decides where a rank computes: its device, its process-group backend,
and whether the CPU kernels are switched on.

Everything else asks this module instead of probing ``torch.cuda`` itself:

* :func:`resolve_device` turns a setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and the
  rank's local rank into a ``torch.device``. ``auto`` means CUDA when a GPU is visible.
  Each rank gets its own GPU: ``local_rank`` modulo the visible GPUs, so a launcher that
  shows every GPU to every process (``torchrun``, the process backend) and Ray, which shows
  each actor only the GPUs it assigned (``CUDA_VISIBLE_DEVICES``), both land on the right one.
* :func:`bind_device` resolves and makes the device current for the process
  (``torch.cuda.set_device``), so NCCL and every default-device allocation use it.
* :func:`process_group_backend` follows the tensors: NCCL for CUDA, gloo for the CPU.
  Never a mismatch (NCCL with CPU tensors fails at the first collective).
* :func:`only_visible_gpu` shows a child process started inside it (vLLM's engine core) only
  the rank's GPU.
* :func:`uses_cpu_kernels` is true only for the CPU: the CPU speed work
  (:mod:`tandem.kernels.cpu`) is never switched on for a GPU run.
* :func:`to_device` moves inputs to a GPU without waiting for the work queued there.
* :func:`uses_cuda_graphs` is true only for CUDA: the native engine's decode steps replay
  CUDA graphs there (:mod:`tandem.rollout.decode_graphs`).
* :func:`available_memory_bytes` is the memory a new allocation on a device may take: the
  GPU's free memory, or on the CPU the kernel's ``MemAvailable`` capped by the cgroup's room
  (the native engine sizes its KV cache from it).
* :func:`worker_start_method` is how worker processes start: forked from a preloaded fork
  server on a host without CUDA, spawned afresh where CUDA is (the server's imports could
  initialise the CUDA driver, which a process forked after that cannot use).
* :func:`cpu_bf16_instructions` names the CPU's bf16 matrix instructions (AMX or AVX-512
  BF16), and :func:`check_bf16_compute` refuses bf16 compute on a CPU that has neither:
  there oneDNN emulates bf16 products with fp32 ones plus conversions, slower than plain fp32
  and still bf16-rounded, so asking for it is a mistake worth an error, not a quiet fallback.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

DEVICE_SETTINGS = ("auto", "cpu", "cuda")
_VISIBILITY = threading.Lock()  # guards CUDA_VISIBLE_DEVICES while only_visible_gpu narrows it


def check_device_setting(owner: str, field: str, value: str) -> None:
    """Raise ``ValueError`` naming ``owner.field`` unless ``value`` is auto, cpu, cuda or cuda:N."""
    base, _, index = value.partition(":")
    if base not in DEVICE_SETTINGS or (index and (base != "cuda" or not index.isdigit())):
        raise ValueError(f"{owner}.{field}={value!r} is not allowed; choose auto, cpu, cuda or cuda:<index>")


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_start_method() -> str:
    """``forkserver`` on a host without CUDA (a worker forks from a server that imported the
    heavy libraries once: :mod:`tandem.controller.local`), ``spawn`` where CUDA is available."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


def resolve_device(setting: str = "auto", local_rank: int = 0) -> torch.device:
    """The device a rank computes on (see the module docstring); ``cuda`` without a GPU is an error."""
    check_device_setting("device", "setting", setting)
    if setting == "cpu":
        return torch.device("cpu")
    count = cuda_device_count()
    if setting == "auto":
        if count == 0:
            return torch.device("cpu")
        setting = "cuda"
    if count == 0:
        raise RuntimeError(f"device {setting!r} was asked for, but this process sees no CUDA GPU")
    if setting == "cuda":
        return torch.device("cuda", local_rank % count)
    index = int(setting.partition(":")[2])
    if index >= count:
        raise RuntimeError(f"device {setting!r} was asked for, but this process sees {count} GPU(s)")
    return torch.device("cuda", index)


def local_rank_from_env() -> int:
    """This process's rank on its node as a launcher sets it (``LOCAL_RANK``; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def bind_device(setting: str = "auto", local_rank: int | None = None) -> torch.device:
    """Resolve the rank's device and make it the process's current CUDA device when it is one.

    ``local_rank`` defaults to the launcher's ``LOCAL_RANK``.
    """
    rank = local_rank_from_env() if local_rank is None else local_rank
    device = resolve_device(setting, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def physical_gpu_id(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's GPU ``index`` (the index itself
    when the variable is unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return str(index)
    entries = [entry.strip() for entry in visible.split(",")]
    if index >= len(entries):
        raise RuntimeError(f"GPU {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[index]


@contextlib.contextmanager
def only_visible_gpu(setting: str, count: int = 1) -> Iterator[None]:
    """Within the block, ``CUDA_VISIBLE_DEVICES`` names only the GPU of ``setting`` (``cuda:N``)
    and the ``count - 1`` after it (a tensor-parallel engine's), so a process started inside it
    sees GPU N as its ``cuda:0``. This process keeps its own view: its CUDA runtime starts first,
    if nothing started it yet, since one starting inside the block (on a library's first CUDA
    call) would see only those GPUs for good. Other settings change nothing."""
    base, _, index = setting.partition(":")
    if base != "cuda" or not index:
        yield
        return
    if torch.cuda.is_available():
        torch.cuda.init()  # idempotent
    with _VISIBILITY:  # one narrowed view at a time, restored before another thread narrows it
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = int(index)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical_gpu_id(first + i) for i in range(count))
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def cpu_bf16_instructions() -> str | None:
    """The CPU's bf16 matrix instructions as torch's CPU feature probe reports them: ``amx_bf16``
    (AMX tiles, Sapphire Rapids and later), ``avx512_bf16`` (AVX-512 BF16, e.g. Cooper Lake, AMD
    Zen 4), or ``None`` where it has neither."""
    probes = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        if getattr(torch.cpu, probe, lambda: False)():
            return name
    return None


def computes_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 natively: a CUDA GPU, or a CPU with
    :func:`cpu_bf16_instructions`."""
    return torch.device(device).type != "cpu" or cpu_bf16_instructions() is not None


def check_bf16_compute(key: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` naming ``key`` (a mixed-precision setting of ``bf16``) when ``device``
    is the CPU and :func:`cpu_bf16_instructions` finds no bf16 matrix instructions on it; a GPU
    passes (every CUDA GPU tandem runs on computes bf16)."""
    if not computes_bf16(device):
        raise ValueError(
            f"{key}=bf16 computes in bf16 on the CPU, but this CPU has no bf16 matrix instructions "
            "(neither avx512_bf16 nor amx_bf16): bf16 products would be emulated, slower than fp32; "
            f"set {key}=none"
        )


def process_group_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on ``device``: ``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def uses_cpu_kernels(device: torch.device | str) -> bool:
    """Whether the CPU kernels package applies to a model computing on ``device``."""
    return torch.device(device).type == "cpu"


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``. A copy from host memory to a GPU does not wait for the work
    already queued there (a plain one synchronises the GPU's stream first; an asynchronous one
    from pageable memory stages the bytes at once and returns), so the host can prepare the
    next input while the GPU computes. Copies back to the host stay synchronous."""
    device = torch.device(device)
    return tensor.to(device, non_blocking=tensor.device.type == "cpu" and device.type == "cuda")


def host_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small tensor of host ``values`` on ``device``, copied as :func:`to_device` copies."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def host_buffer(nbytes: int, for_device: torch.device | str) -> torch.Tensor:
    """An empty byte buffer in host memory for data of ``for_device``: page-locked for a CUDA
    device, so copies to and from it run at full bus speed and asynchronously (PyTorch's
    pinned-memory cache keeps freed buffers for the next request, in power-of-two sizes). Where
    the system refuses to lock more memory the buffer is pageable, with a warning."""
    if torch.device(for_device).type == "cuda":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            warnings.warn(
                f"page-locked host memory refused ({error}); offload copies run pageable", stacklevel=2
            )
    return torch.empty(nbytes, dtype=torch.uint8)


def zeros_on_use(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose host memory is taken only as it is written (a large cache sized for
    the worst case, most of it never touched). On the CPU it lives in an anonymous memory map:
    the kernel hands out zeroed pages on first write, and a page only ever read is the shared zero
    page, so the process's resident memory grows with what is written, not with ``shape``
    (``torch.zeros`` writes every byte at once). Elsewhere it is ``torch.zeros``."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():  # the map is writable: torch's "non-writable buffer" warning is moot
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps the map alive


def wait_for_copies(device: torch.device | str) -> None:
    """Block until the work queued on a CUDA ``device``'s current stream (asynchronous copies
    to host memory among it) is done; nothing elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def uses_cuda_graphs(device: torch.device | str) -> bool:
    """Whether the native engine's decode steps may replay CUDA graphs on ``device``."""
    return torch.device(device).type == "cuda"


def max_memory_allocated_gb(device: torch.device | str) -> float | None:
    """Peak memory allocated on a CUDA ``device`` since the last reset, in GB (None elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e9


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window on a CUDA ``device`` (nothing elsewhere)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_cached_memory(device: torch.device | str) -> None:
    """Hand a CUDA ``device``'s cached free blocks back to the driver (nothing elsewhere), so
    another allocator in the process (vLLM's, say) can use the memory an offload freed."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def available_memory_bytes(device: torch.device | str) -> int | None:
    """Bytes a new allocation on ``device`` may take now: ``torch.cuda.mem_get_info``'s free
    memory on a GPU; on the CPU ``/proc/meminfo``'s ``MemAvailable``, capped by the room left
    under this process's cgroup memory limit (v2 or v1; reclaimable page cache counts as room).
    ``None`` where the system does not say (no ``/proc/meminfo``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = _meminfo_available()
    room = _cgroup_room()
    if available is None:
        return room
    return available if room is None else min(available, room)


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or ``None`` without it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# (limit, usage, stat file, its inactive page-cache key) of cgroup v2, then v1
_CGROUPS = (
    (
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory.current",
        "/sys/fs/cgroup/memory.stat",
        "inactive_file",
    ),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def _cgroup_room() -> int | None:
    """Bytes left under the cgroup's memory limit (limit - usage + inactive page cache), or
    ``None`` when no limit is set (v2's ``max``, v1's huge number) or readable."""
    for limit_file, usage_file, stat_file, inactive_key in _CGROUPS:
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None
        inactive = 0
        try:
            for line in Path(stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit_text) - usage + inactive)
    return None
