"""CUDA forms of the kernels: ``numba.cuda`` kernels over torch's CUDA tensors, without copies.

Every kernel starts through :func:`launch`, on torch's current stream, so kernels and the torch
ops around them stay ordered without a host sync. On a GPU :func:`launch` calls the compiled
kernel directly with the parameters Numba would build (its dispatcher's own launch costs several
times the work of a training step's small kernels; ``docs/gpu.md`` has the measurements). The
only host syncs are the sizes of data-dependent outputs (number of unique rows, a select's
values unless its caller passes ``num_out_values``); the backward of a select
(:func:`jagged_index_add`) knows every size and reads nothing back.

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``, used by CI without a GPU) the same code runs
on CPU tensors: :func:`launch` goes through the dispatcher with numpy views
(:func:`as_device_array`) and the torch glue runs on the CPU. The row hash, list comparison,
partial-dedup rule and running max are the bodies of :mod:`recpipe.kernels.bodies`, shared with
the CPU forms; a hash match is always verified.

Algorithms: ``dedup_rows`` hashes every row (all keys) in parallel, sorts the hashes (stable,
so equal hashes list rows in batch order) and lets each row scan its hash run for the first row
equal on every key; ``partial_dedup`` classifies each row against the previous one in parallel
and places windows with a prefix sum; the jagged select computes its output offsets in one
launch (a block scans the selected rows' lengths) and gives a warp to each output row, each lane
keeping four 8-byte words in flight (:data:`SELECT_LAYOUT`); its backward (the jagged add) gives
a block to each output row and adds every gradient element atomically into its source element
(:data:`ADD_LAYOUT`; atomics: not bitwise from run to run where a row repeats), or a block to
each run of equal consecutive indices, summed before one atomic add (``"run"``). The segment
reductions give one thread to each (row, column).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import torch
from numba import config as _numba_config
from numba import int64

from recpipe._deps import optional_import
from recpipe.errors import DependencyError, RecpipeError
from recpipe.kernels.arrays import Array, as_bits, compute_dtype, flat2d, row_width
from recpipe.kernels.bodies import BASIS_A, BASIS_B, compile_bodies

cuda = optional_import("numba.cuda", purpose="the CUDA kernels of recpipe.kernels")
try:  # numba-cuda's own launch layer; without it every launch goes through the dispatcher
    import cuda.core as _core
except ImportError:
    _core = None

__all__ = [
    "ADD_LAYOUT",
    "SELECT_LAYOUT",
    "add_into",
    "as_device_array",
    "dedup_rows",
    "is_simulator",
    "jagged_index_add",
    "jagged_index_select",
    "launch",
    "partial_dedup",
    "segment_reduce",
    "segment_reduce_backward",
    "select_into",
    "torch_stream",
]


def is_simulator() -> bool:
    """True when Numba's CUDA simulator stands in for a GPU (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(getattr(_numba_config, "ENABLE_CUDASIM", 0))


def _threads(gpu: int = 256) -> int:
    """Threads per block: ``gpu`` on a device, one warp in the simulator (it runs threads as
    Python)."""
    return 32 if is_simulator() else gpu


def _blocks(n: int, threads: int, cap: int = 65535) -> int:
    return max(1, min(cap, (n + threads - 1) // threads))


def as_device_array(tensor: torch.Tensor) -> Any:
    """A Numba device array sharing ``tensor``'s memory (a numpy view under the simulator).

    Raises:
        DependencyError: a CPU tensor reached the CUDA kernels without the simulator.
    """
    tensor = tensor.detach().contiguous()
    if tensor.is_cuda:
        return cuda.as_cuda_array(tensor, sync=False)
    if is_simulator():
        return tensor.numpy()
    msg = (
        f"the CUDA kernels need CUDA tensors, got one on {tensor.device}\n"
        "hint: move it with `.to('cuda')`, or set NUMBA_ENABLE_CUDASIM=1 to simulate"
    )
    raise DependencyError(msg)


def torch_stream(device: torch.device) -> Any:
    """Torch's current stream on ``device`` as a Numba stream (``0`` under the simulator)."""
    if device.type != "cuda":
        return 0
    return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)


Arg = torch.Tensor | int

_DIRECT: dict[tuple[Any, ...], Any] = {}  # (kernel, argument types) -> compiled kernel or None
_CORE_STREAMS: dict[int, Any] = {}  # torch stream handle -> the same stream for cuda.core


def launch(kernel: Any, blocks: int, threads: int, device: torch.device, *args: Arg) -> None:
    """Run ``kernel[blocks, threads]`` on torch's current stream over tensors and ints.

    On a GPU the compiled kernel is launched directly with the parameters Numba's dispatcher
    would build (an array is its size, item size, pointer, shape and strides, all 8-byte
    values): the dispatcher's own launch costs far more host time than the small kernels of a
    training step take to run. The parameters go through ``cuda.core.launch``, or, with
    ``RECPIPE_CUDA_LAUNCH=driver``, to the driver's ``cuLaunchKernel`` packed in one buffer
    (:class:`_DriverLauncher`: less host work per launch; opt-in until every kernel has run
    through it on a device). The first
    launch of each kernel and argument types compiles through the dispatcher; where no direct
    route exists (another numba-cuda, the simulator), or with ``RECPIPE_CUDA_LAUNCH=dispatcher``,
    the dispatcher launches every time.
    """
    # no detach: only pointers and sizes are read here (as_device_array detaches for Numba)
    tensors = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    compiled = _compiled(kernel, tensors) if device.type == "cuda" else None
    if compiled is None:
        dev_args = [as_device_array(a) if isinstance(a, torch.Tensor) else a for a in tensors]
        kernel[blocks, threads, torch_stream(device)](*dev_args)
        return
    driver = _driver()
    if driver is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver.launch(compiled, blocks, threads, index, _raw_stream(index), _param_words(tensors))
        return
    config = _CONFIGS.get((blocks, threads))
    if config is None:
        config = _CONFIGS[blocks, threads] = _core.LaunchConfig(
            grid=(blocks, 1, 1), block=(threads, 1, 1), shmem_size=0
        )
    _core.launch(_core_stream(device), config, compiled, *_flat_args(tensors))


_CONFIGS: dict[tuple[int, int], Any] = {}  # (blocks, threads) -> cuda.core launch configuration


def _route() -> str:
    """``RECPIPE_CUDA_LAUNCH``: ``core`` (default), ``driver`` or ``dispatcher``.

    ``driver`` (:class:`_DriverLauncher`) is opt-in: on an H200 the select and the add ran
    through it (tested against the CPU forms, 0.03-0.05 ms faster a call), the other kernels
    not yet (``docs/gpu.md``). Read once, at the first launch."""
    route = os.environ.get("RECPIPE_CUDA_LAUNCH", "core")
    if route not in _ROUTES:
        msg = f"`RECPIPE_CUDA_LAUNCH` must be one of {', '.join(_ROUTES)}, got {route!r}"
        raise RecpipeError(msg)
    return route


_ROUTES = ("core", "driver", "dispatcher")


def _compiled(kernel: Any, tensors: list[Arg]) -> Any:
    """The compiled form of ``kernel`` for these argument types (``None``: use the dispatcher)."""
    key = (kernel, *((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else int for a in tensors))
    if key not in _DIRECT:
        _DIRECT[key] = None
        if _core is not None and _route() != "dispatcher":
            examples = [as_device_array(a) if isinstance(a, torch.Tensor) else a for a in tensors]
            try:
                overloads = kernel.specialize(*examples).overloads
                _DIRECT[key] = next(iter(overloads.values()))._codelibrary.get_cufunc().kernel
            except (AttributeError, StopIteration, TypeError):
                pass  # this numba-cuda compiles another way: its dispatcher launches
    return _DIRECT[key]


class _DriverLauncher:
    """``cuLaunchKernel`` through ctypes, every parameter in one packed buffer.

    Numba passes each kernel parameter as an 8-byte value (pointers, sizes, shapes, strides and
    int64 scalars), so the parameter buffer is those values in order
    (``CU_LAUNCH_PARAM_BUFFER_POINTER``): one ctypes array and one driver call per launch,
    where ``cuda.core.launch`` converts every parameter to an object of its own. The compiled
    kernel (a library kernel) is resolved once to its function in the current context.
    """

    _BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0  # cuLaunchKernel's ``extra`` markers

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._get_function = lib.cuKernelGetFunction
        self._get_function.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._get_function.restype = ctypes.c_int
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        self._launch.restype = ctypes.c_int
        self._functions: dict[tuple[int, int], int] = {}  # (id(kernel), device) -> CUfunction

    def _function(self, compiled: Any, device: int) -> int:
        func = self._functions.get((id(compiled), device))
        if func is None:
            out = ctypes.c_void_p()
            rc = self._get_function(ctypes.byref(out), int(compiled.handle))
            if rc != 0 or not out.value:
                msg = f"cuKernelGetFunction failed with CUDA error {rc}"
                raise DependencyError(msg)
            func = self._functions[id(compiled), device] = int(out.value)
        return func

    def launch(
        self, compiled: Any, blocks: int, threads: int, device: int, stream: int, words: list[int]
    ) -> None:
        params = (ctypes.c_int64 * len(words))(*words)
        size = ctypes.c_size_t(ctypes.sizeof(params))
        extra = (ctypes.c_void_p * 5)(
            self._BUFFER_POINTER, ctypes.addressof(params), self._BUFFER_SIZE,
            ctypes.addressof(size), self._END,
        )  # fmt: skip
        rc = self._launch(
            self._function(compiled, device), blocks, 1, 1, threads, 1, 1, 0, stream, None, extra
        )
        if rc != 0:
            msg = f"cuLaunchKernel failed with CUDA error {rc} ({blocks} blocks of {threads})"
            raise DependencyError(msg)


_DRIVER: list[_DriverLauncher | None] = []  # filled on first use


def _driver() -> _DriverLauncher | None:
    """The driver-level launcher, or ``None`` where it is not to be used or not there."""
    if not _DRIVER:
        launcher = None
        if _route() == "driver":
            try:
                launcher = _DriverLauncher(ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError):
                launcher = None  # no driver library by that name: cuda.core launches
        _DRIVER.append(launcher)
    return _DRIVER[0]


def _raw_stream(index: int) -> int:
    """Torch's current stream on device ``index`` as its CUDA handle (the raw call where torch
    has it: it builds no Python stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _core_stream(device: torch.device) -> Any:
    handle = _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    stream = _CORE_STREAMS.get(handle)
    if stream is None:
        stream = _CORE_STREAMS[handle] = _core.Stream.from_handle(handle)
    return stream


def _param_words(tensors: list[Arg]) -> list[int]:
    """The kernel parameters Numba passes for these arguments, as 8-byte integers (contiguous
    tensors: meminfo, parent, size, item size, pointer, shape, strides in bytes; ints)."""
    words: list[int] = []
    for a in tensors:
        if isinstance(a, torch.Tensor):
            size = a.element_size()
            words += [0, 0, a.numel(), size, a.data_ptr(), *a.shape]
            words += [stride * size for stride in a.stride()]
        else:
            words.append(a)
    return words


def _flat_args(tensors: list[Arg]) -> list[Any]:
    """:func:`_param_words` as ``cuda.core.launch`` takes them (ints as ``c_int64``)."""
    flat: list[Any] = []
    for a in tensors:
        flat += _param_words([a]) if isinstance(a, torch.Tensor) else [ctypes.c_int64(a)]
    return flat


# --------------------------------------------------------------------------------------------
# device functions: the bodies shared with the CPU forms


_BODIES = compile_bodies(cuda.jit(device=True))
_lists_equal = _BODIES["lists_equal"]
_fold_list = _BODIES["fold_list"]
_appended_ids = _BODIES["appended_ids"]
_running_max = _BODIES["running_max"]


# --------------------------------------------------------------------------------------------
# dedup_rows


@cuda.jit(cache=True)
def _hash_rows(values: Array, offsets: Array, h1: Array, h2: Array) -> None:
    """Fold each row's list into its two 31-bit hash lanes (one call per key)."""
    start_row, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start_row, offsets.shape[0] - 1, stride):
        h1[i], h2[i] = _fold_list(values, offsets[i], offsets[i + 1], h1[i], h2[i])


@cuda.jit(cache=True)
def _resolve(
    values: Array, offsets: Array, perm: Array, run_start: Array, prev_rep: Array, rep: Array
) -> None:
    """``rep[i]``: the first row of ``i``'s hash run equal to ``i`` on this and earlier keys."""
    start_pos, stride = cuda.grid(1), cuda.gridsize(1)
    for p in range(start_pos, perm.shape[0], stride):
        i = perm[p]
        for q in range(run_start[p], p + 1):
            j = perm[q]
            if prev_rep[j] == prev_rep[i] and _lists_equal(
                values, offsets[j], offsets[j + 1], offsets[i], offsets[i + 1]
            ):
                rep[i] = j
                break


def dedup_rows(
    values: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    *,
    hash_mask: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA form of :func:`recpipe.kernels.dedup_rows`."""
    device = offsets[0].device
    num_rows = offsets[0].shape[0] - 1
    threads = _threads()
    blocks = _blocks(num_rows, threads)
    h1 = torch.full((num_rows,), BASIS_A, dtype=torch.int64, device=device)
    h2 = torch.full((num_rows,), BASIS_B, dtype=torch.int64, device=device)
    keys = [(v.contiguous(), o.contiguous()) for v, o in zip(values, offsets)]
    for key_values, key_offsets in keys:  # loops over keys, not rows
        launch(_hash_rows, blocks, threads, device, key_values, key_offsets, h1, h2)
    hashes = ((h1 << 31) | h2) & hash_mask
    sorted_hashes, perm = torch.sort(hashes, stable=True)
    positions = torch.arange(num_rows, device=device)
    boundary = torch.ones(num_rows, dtype=torch.bool, device=device)
    boundary[1:] = sorted_hashes[1:] != sorted_hashes[:-1]
    run_start = torch.where(boundary, positions, 0).cummax(0).values
    rep = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for key_values, key_offsets in keys:
        prev_rep, rep = rep, torch.empty_like(rep)
        launch(
            _resolve, blocks, threads, device, key_values, key_offsets, perm, run_start,
            prev_rep, rep,
        )  # fmt: skip
    is_unique = rep == positions
    unique_rows = torch.nonzero(is_unique).reshape(-1)
    inverse = (torch.cumsum(is_unique, 0) - 1)[rep]
    return unique_rows, inverse


# --------------------------------------------------------------------------------------------
# partial_dedup


@cuda.jit(cache=True)
def _partial_counts(values: Array, offsets: Array, appended: Array) -> None:
    start_row, stride = cuda.grid(1), cuda.gridsize(1)
    for r in range(start_row, offsets.shape[0] - 1, stride):
        appended[r] = _appended_ids(values, offsets, r)


@cuda.jit(cache=True)
def _partial_fill(
    values: Array, offsets: Array, appended: Array, tails: Array, packed: Array
) -> None:
    start_row, stride = cuda.grid(1), cuda.gridsize(1)
    for r in range(start_row, offsets.shape[0] - 1, stride):
        count = appended[r]
        src = offsets[r + 1] - count
        dst = tails[r] - count
        for k in range(count):
            packed[dst + k] = values[src + k]


def partial_dedup(
    values: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA form of :func:`recpipe.kernels.partial_dedup`."""
    device = values.device
    num_rows = offsets.shape[0] - 1
    threads = _threads()
    blocks = _blocks(num_rows, threads)
    appended = torch.empty(num_rows, dtype=torch.int64, device=device)
    values, offsets = values.contiguous(), offsets.contiguous()
    launch(_partial_counts, blocks, threads, device, values, offsets, appended)
    tails = torch.cumsum(appended, 0)  # end of the packed values after each row
    win_lengths = offsets[1:] - offsets[:-1]
    win_offsets = tails - win_lengths
    packed_len = int(tails[-1]) if num_rows else 0
    packed = torch.empty(packed_len, dtype=values.dtype, device=device)
    launch(_partial_fill, blocks, threads, device, values, offsets, appended, tails, packed)
    return packed, win_offsets, win_lengths


# --------------------------------------------------------------------------------------------
# jagged_index_select / jagged_index_add


_WARP = 32

SELECT_LAYOUT = "row"
"""How :func:`jagged_index_select` spreads its work over threads.

``"row"`` (default): a warp per output row, each lane loading four words (8 bytes where rows
allow) before it stores them. ``"word"``: the output's words in tiles, a few words to each
thread and consecutive threads on consecutive words whatever the rows' lengths; a word's row is
the previous word's, or found from it by a binary search of ``out_offsets`` where a row ends
(:data:`ADD_LAYOUT` ``"word"`` is the same for the add). ``benchmarks/kernels.py`` times both
(``select_kernel_<layout>_ms``): on an H200 at 16,384 rows of 20-50 values x 64 floats the row
kernel took 0.127 ms against 0.218 ms for the word kernel (the rows are long enough to keep a
warp's lanes busy; that was before the row kernel kept four loads in flight).
"""


_WORDS_PER_THREAD = 4  # each thread loads this many words before it stores them


@cuda.jit(device=True)
def _advance(out_offsets: Array, m: int, v: int) -> int:
    """The row holding output value ``v`` (``out_offsets[m] <= v < out_offsets[-1]``), found
    from row ``m`` on: the next two rows, then a binary search (which steps over empty rows)."""
    if out_offsets[m + 1] > v:
        return m
    if out_offsets[m + 2] > v:
        return m + 1
    lo = m + 2
    hi = out_offsets.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if out_offsets[mid] <= v:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _row_at(
    out_offsets: Array, src_offsets: Array, indices: Array, m: int, w: int, width: int
) -> tuple[int, int, int]:
    """``(row, shift, end)`` of output word ``w``, its row found from row ``m`` on: its source
    word is ``w + shift`` and its row's words end before ``end``."""
    m = _advance(out_offsets, m, w // width)
    return m, (src_offsets[indices[m]] - out_offsets[m]) * width, out_offsets[m + 1] * width


@cuda.jit(cache=True)
def _select_words(
    values: Array, offsets: Array, indices: Array, out_offsets: Array, width: int, out: Array
) -> None:
    """Block ``b`` of ``T`` threads moves output words ``[b T K, (b + 1) T K)``, thread ``t`` the
    words ``t, t + T, ...`` (each step a coalesced sweep of the block); each word's row is the
    previous word's or found from it, so a division and a search happen only where a row ends."""
    step = cuda.blockDim.x
    first = cuda.blockIdx.x * step * _WORDS_PER_THREAD + cuda.threadIdx.x
    n = out.shape[0]
    if first >= n:
        return
    buf = cuda.local.array(_WORDS_PER_THREAD, out.dtype)
    m, shift, end = _row_at(out_offsets, offsets, indices, 0, first, width)
    w = first
    for i in range(_WORDS_PER_THREAD):  # every load first, so they are in flight together
        if w < n:
            if w >= end:
                m, shift, end = _row_at(out_offsets, offsets, indices, m, w, width)
            buf[i] = values[w + shift]
        w += step
    w = first
    for i in range(_WORDS_PER_THREAD):
        if w < n:
            out[w] = buf[i]
        w += step


@cuda.jit(cache=True)
def _select_rows(
    values: Array, offsets: Array, indices: Array, out_offsets: Array, width: int, out: Array
) -> None:
    """One warp per output row (grid-stride), its lanes over the row's words, each lane loading
    four words (a warp's four sweeps) before it stores them, so four loads are in flight."""
    lane = cuda.threadIdx.x % _WARP
    for m in range(cuda.grid(1) // _WARP, indices.shape[0], cuda.gridsize(1) // _WARP):
        src = offsets[indices[m]] * width
        dst = out_offsets[m] * width
        n = (out_offsets[m + 1] - out_offsets[m]) * width
        k = lane
        while k + 3 * _WARP < n:
            a = values[src + k]
            b = values[src + k + _WARP]
            c = values[src + k + 2 * _WARP]
            d = values[src + k + 3 * _WARP]
            out[dst + k] = a
            out[dst + k + _WARP] = b
            out[dst + k + 2 * _WARP] = c
            out[dst + k + 3 * _WARP] = d
            k += 4 * _WARP
        while k < n:
            out[dst + k] = values[src + k]
            k += _WARP


_SCAN_THREADS = 1024  # the one block of :func:`_selected_offsets` on a device


@cuda.jit(cache=True)
def _selected_offsets(offsets: Array, indices: Array, out_offsets: Array) -> None:
    """``out_offsets`` of the rows ``indices`` selects, in one block: each thread sums the
    lengths of a contiguous chunk of rows, the block scans the chunk sums in shared memory, and
    each thread writes its chunk's offsets from its prefix."""
    t = cuda.threadIdx.x
    threads = cuda.blockDim.x
    rows = indices.shape[0]
    chunk = (rows + threads - 1) // threads
    lo = min(t * chunk, rows)
    hi = min(lo + chunk, rows)
    total = 0
    for m in range(lo, hi):
        r = indices[m]
        total += offsets[r + 1] - offsets[r]
    sums = cuda.shared.array(_SCAN_THREADS, int64)
    sums[t] = total
    cuda.syncthreads()
    step = 1
    while step < threads:  # inclusive scan of the chunk sums (Hillis-Steele)
        before = sums[t - step] if t >= step else 0
        cuda.syncthreads()
        sums[t] += before
        cuda.syncthreads()
        step *= 2
    at = sums[t] - total
    if t == 0:
        out_offsets[0] = 0
    for m in range(lo, hi):
        r = indices[m]
        at += offsets[r + 1] - offsets[r]
        out_offsets[m + 1] = at


@cuda.jit(cache=True)
def _add_words(
    grad: Array, out_offsets: Array, src_offsets: Array, indices: Array, width: int, out: Array
) -> None:
    """The select's layout (:func:`_select_words`) over gradient elements, each added
    atomically to its source element."""
    step = cuda.blockDim.x
    first = cuda.blockIdx.x * step * _WORDS_PER_THREAD + cuda.threadIdx.x
    n = grad.shape[0]
    if first >= n:
        return
    buf = cuda.local.array(_WORDS_PER_THREAD, grad.dtype)
    w = first
    for i in range(_WORDS_PER_THREAD):
        if w < n:
            buf[i] = grad[w]
        w += step
    m, shift, end = _row_at(out_offsets, src_offsets, indices, 0, first, width)
    w = first
    for i in range(_WORDS_PER_THREAD):
        if w < n:
            if w >= end:
                m, shift, end = _row_at(out_offsets, src_offsets, indices, m, w, width)
            cuda.atomic.add(out, w + shift, buf[i])
        w += step


@cuda.jit(cache=True)
def _add_rows(
    grad: Array, out_offsets: Array, src_offsets: Array, indices: Array, width: int, out: Array
) -> None:
    """One block per output row (grid-stride), its threads over the row's elements."""
    for m in range(cuda.blockIdx.x, indices.shape[0], cuda.gridDim.x):
        src = out_offsets[m] * width
        dst = src_offsets[indices[m]] * width
        for k in range(
            cuda.threadIdx.x, (out_offsets[m + 1] - out_offsets[m]) * width, cuda.blockDim.x
        ):
            cuda.atomic.add(out, dst + k, grad[src + k])


_RUN_ROWS = 32  # a run of equal indices is summed in pieces that start at multiples of this


@cuda.jit(cache=True)
def _add_runs(
    grad: Array, out_offsets: Array, src_offsets: Array, indices: Array, width: int, out: Array
) -> None:
    """One block per output row (grid-stride); a row that starts a piece of a run of equal
    indices (the first of its run, or at a multiple of ``_RUN_ROWS``) sums the piece's rows in
    batch order and adds the sum to the source row with one atomic add per element; the other
    rows' blocks leave at once. Each thread sums four elements at a time (four loads in flight
    per row of the run). A session-clustered batch repeats a row in consecutive rows, so this
    makes a run's worth fewer atomic adds than a block per row."""
    rows = indices.shape[0]
    step = cuda.blockDim.x
    for m in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        r = indices[m]
        if m % _RUN_ROWS != 0 and indices[m - 1] == r:
            continue
        end = m + 1
        stop = min(rows, m - m % _RUN_ROWS + _RUN_ROWS)
        while end < stop and indices[end] == r:
            end += 1
        dst = src_offsets[r] * width
        first = out_offsets[m] * width
        n = (out_offsets[m + 1] - out_offsets[m]) * width
        for k0 in range(cuda.threadIdx.x, n, 4 * step):
            # an element past the row reads the row's last one (same dtype) and is not added
            k1 = min(k0 + step, n - 1)
            k2 = min(k0 + 2 * step, n - 1)
            k3 = min(k0 + 3 * step, n - 1)
            a0 = grad[first + k0]
            a1 = grad[first + k1]
            a2 = grad[first + k2]
            a3 = grad[first + k3]
            for j in range(m + 1, end):
                at = out_offsets[j] * width
                a0 += grad[at + k0]
                a1 += grad[at + k1]
                a2 += grad[at + k2]
                a3 += grad[at + k3]
            cuda.atomic.add(out, dst + k0, a0)
            if k0 + step < n:
                cuda.atomic.add(out, dst + k1, a1)
            if k0 + 2 * step < n:
                cuda.atomic.add(out, dst + k2, a2)
            if k0 + 3 * step < n:
                cuda.atomic.add(out, dst + k3, a3)


def _tiles(n: int, threads: int) -> int:
    """Blocks of :func:`_select_words` and :func:`_add_words` for ``n`` words (no grid-stride:
    a grid's x dimension takes 2**31 - 1 blocks)."""
    return max(1, -(-n // (threads * _WORDS_PER_THREAD)))


def select_into(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    out_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    layout: str | None = None,
) -> None:
    """Copy the selected rows of ``values`` into ``out`` (``[out_offsets[-1], ...]``, not empty).

    The launch alone, no allocation: what the select costs beyond its output offsets.
    ``layout``: ``"word"`` or ``"row"`` (default :data:`SELECT_LAYOUT`).
    """
    layout = layout or SELECT_LAYOUT
    src_words, width = _words(values.detach())
    out_words, _ = _words(out)
    threads = _threads()
    if layout == "word":
        blocks, kernel = _tiles(out_words.shape[0], threads), _select_words
    else:
        blocks, kernel = _blocks(indices.shape[0] * _WARP, threads), _select_rows  # warp per row
    launch(
        kernel, blocks, threads, out.device, src_words, offsets, indices, out_offsets, width,
        out_words,
    )  # fmt: skip


ADD_LAYOUT = "row"
"""How :func:`jagged_index_add` spreads its work: ``"row"`` (default), a block per output row;
``"word"``, the select's word tiles, both one atomic add per gradient element; ``"run"``, a
block per run of equal consecutive indices (:func:`_add_runs`), which sums the run's rows
before one atomic add per element. ``benchmarks/kernels.py`` times all three
(``add_kernel_<layout>``). On an H200 at 16,384 rows (runs of about 5 rows) the row kernel took
0.110 ms of device time, the run kernel 0.117 ms (0.134 ms before it kept four loads in flight):
fewer atomic adds do not pay for the serial sums at that size; at 131,072 rows the run kernel
was faster (0.689 against 0.773 ms)."""


def add_into(
    grad: torch.Tensor,
    out_offsets: torch.Tensor,
    src_offsets: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    layout: str | None = None,
) -> None:
    """Add ``grad`` (``[out_offsets[-1], ...]``, not empty) into ``out`` (``[N, ...]``, the same
    dtype, one of the atomic adds' float32 or float64) by the select's rows; ``layout``:
    ``"run"``, ``"row"`` or ``"word"`` (default :data:`ADD_LAYOUT`)."""
    layout = layout or ADD_LAYOUT
    flat = grad.detach().reshape(-1)
    width = row_width(grad)
    if layout == "word":
        threads = _threads()
        blocks, kernel = _tiles(flat.shape[0], threads), _add_words
    else:
        threads = _threads(128)
        blocks = min(indices.shape[0], 65535)  # a block per row
        kernel = _add_runs if layout == "run" else _add_rows
    launch(
        kernel, blocks, threads, out.device, flat, out_offsets, src_offsets, indices, width,
        out.reshape(-1),
    )  # fmt: skip


def _out_offsets(offsets: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The selected rows' offsets, computed on the device by one launch."""
    out_offsets = torch.empty(indices.shape[0] + 1, dtype=torch.int64, device=offsets.device)
    launch(_selected_offsets, 1, _threads(_SCAN_THREADS), offsets.device, offsets, indices,
           out_offsets)  # fmt: skip
    return out_offsets


def _words(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``tensor``'s bytes as a flat integer tensor and the number of its elements per row.

    8-byte words where every row is a whole number of them (so each thread of the select moves
    8 bytes), else elements of the tensor's own width.
    """
    flat = as_bits(tensor).reshape(-1)
    size = flat.element_size()
    row_bytes = row_width(tensor) * size
    if size < 8 and row_bytes % 8 == 0 and flat.storage_offset() * size % 8 == 0:
        return flat.view(torch.int64), row_bytes // 8
    return flat, row_bytes // size


def jagged_index_select(
    values: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    *,
    out_offsets: torch.Tensor | None = None,
    num_out_values: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA form of :func:`recpipe.kernels.jagged_index_select` (indices are not range-checked).

    ``out_offsets`` and ``num_out_values``, when the caller knows them, are trusted (not checked
    against the selected rows: that would read them back). Without ``num_out_values`` the
    output's size is the one value read back from the device (``out_offsets[-1]``, one sync).
    """
    device = values.device
    if out_offsets is None:
        out_offsets = _out_offsets(offsets, indices)
    total = int(out_offsets[-1]) if num_out_values is None else num_out_values
    out = torch.empty((total, *values.shape[1:]), dtype=values.dtype, device=device)
    if total == 0:
        return out, out_offsets
    select_into(values, offsets, indices, out_offsets, out)
    return out, out_offsets


def jagged_index_add(
    grad_values: torch.Tensor,
    out_offsets: torch.Tensor,
    src_offsets: torch.Tensor,
    indices: torch.Tensor,
    num_src_values: int,
) -> torch.Tensor:
    """CUDA form of :func:`recpipe.kernels.jagged_index_add` (atomic adds, float32 for halves).

    Every size is known on the host: nothing is read back from the device.
    """
    device = grad_values.device
    acc_dtype = compute_dtype(grad_values.dtype)
    out = torch.zeros((num_src_values, *grad_values.shape[1:]), dtype=acc_dtype, device=device)
    if grad_values.numel() and indices.shape[0]:
        add_into(grad_values.to(acc_dtype), out_offsets, src_offsets, indices, out)
    return out.to(grad_values.dtype)


# --------------------------------------------------------------------------------------------
# segment_reduce


@cuda.jit(cache=True)
def _segment_reduce(values: Array, offsets: Array, mode: int, out: Array, argmax: Array) -> None:
    """One thread per (row, column); ``mode`` 0 sum, 1 mean, 2 max."""
    width = values.shape[1]
    start_cell, stride = cuda.grid(1), cuda.gridsize(1)
    for cell in range(start_cell, out.shape[0] * width, stride):
        b = cell // width
        d = cell - b * width
        start = offsets[b]
        end = offsets[b + 1]
        if mode == 2:
            if end == start:
                argmax[b, d] = -1
                continue
            out[b, d], argmax[b, d] = _running_max(values, start, end, d)
        else:
            acc = out[b, d]
            for p in range(start, end):
                acc += values[p, d]
            if mode == 1 and end > start:
                acc /= end - start
            out[b, d] = acc


@cuda.jit(cache=True)
def _segment_reduce_backward(
    grad_out: Array, offsets: Array, mode: int, argmax: Array, grad_values: Array
) -> None:
    width = grad_out.shape[1]
    start_cell, stride = cuda.grid(1), cuda.gridsize(1)
    for cell in range(start_cell, grad_out.shape[0] * width, stride):
        b = cell // width
        d = cell - b * width
        g = grad_out[b, d]
        if mode == 2:
            at = argmax[b, d]
            if at >= 0:
                grad_values[at, d] = g
            continue
        start = offsets[b]
        end = offsets[b + 1]
        if mode == 1 and end > start:
            g /= end - start
        for p in range(start, end):
            grad_values[p, d] = g


_MODE_CODES = {"sum": 0, "mean": 1, "max": 2}


def segment_reduce(
    values: torch.Tensor, offsets: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CUDA form of :func:`recpipe.kernels.segment_reduce`; returns ``(out, argmax or None)``."""
    device = values.device
    num_rows = offsets.shape[0] - 1
    acc_dtype = compute_dtype(values.dtype)
    values2d = flat2d(values.detach().to(acc_dtype))
    width = values2d.shape[1]
    out = torch.zeros((num_rows, width), dtype=acc_dtype, device=device)
    argmax = torch.empty((num_rows, width), dtype=torch.int64, device=device)
    cells = num_rows * width
    if cells:
        threads = _threads()
        launch(
            _segment_reduce, _blocks(cells, threads), threads, device, values2d, offsets,
            _MODE_CODES[mode], out, argmax,
        )  # fmt: skip
    out = out.reshape(num_rows, *values.shape[1:]).to(values.dtype)
    return out, argmax if mode == "max" else None


def segment_reduce_backward(
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    *,
    argmax: torch.Tensor | None,
    num_values: int,
) -> torch.Tensor:
    """CUDA form of :func:`recpipe.kernels.cpu.segment_reduce_backward`."""
    device = grad_out.device
    acc_dtype = compute_dtype(grad_out.dtype)
    grad2d = flat2d(grad_out.to(acc_dtype))
    num_rows, width = grad2d.shape
    fill = torch.zeros if mode == "max" else torch.empty
    grad_values = fill((num_values, width), dtype=acc_dtype, device=device)
    if argmax is None:
        argmax = torch.empty((0, 0), dtype=torch.int64, device=device)
    cells = num_rows * width
    if cells:
        threads = _threads()
        launch(
            _segment_reduce_backward, _blocks(cells, threads), threads, device, grad2d, offsets,
            _MODE_CODES[mode], argmax, grad_values,
        )  # fmt: skip
    return grad_values.reshape(num_values, *grad_out.shape[1:]).to(grad_out.dtype)
