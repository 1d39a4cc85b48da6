"""Benchmark the recpipe kernels against baselines measured in the same run.

Data: batches of ``--rows`` rows of session-clustered synthetic id lists (sessions of 1 to
``2 * --session-rows - 1`` rows, lists of ``--min-len`` to ``--max-len`` ids; rows of a session
repeat the session's list, so the dedup factor is about ``--session-rows``). A three-feature
group changes its second and third lists mid-session now and then (unsynchronised keys).

Figures (all ratios are measured in this run, on ``--threads`` threads, default 1 = per core;
every case is warmed up once, untimed, then the cases alternate with the order rotating each
repeat (``_common.alternate``), the median is kept and ``<figure>_spread`` holds the spread over
the repeats, with the CPU-time ratio beside the wall-time one):

* ``dedup_rows_per_s``: rows/s through ``recpipe.kernels.dedup_rows`` (one feature) streaming
  over ``--batches`` distinct batches (``_warm_cache``: one batch again and again), next to a
  NumPy row hash + ``np.unique`` (collisions not verified) and ``torch.unique(dim=0)`` on rows
  padded to dense; ``dedup_rows_per_s_3_features`` for the three-feature group.
* ``jagged_index_select_speedup``: forward + backward of ``jagged_index_select`` expanding the
  unique rows' float32 ``[N_u, --dim]`` values to the batch, vs the pre-RecD way (pad to dense
  ``[U, L, D]``, ``torch.index_select``, back to jagged by a mask; backward by autograd).
  ``peak_memory_ratio`` = baseline peak / ours: the peak of the running sum of every allocation
  and free torch's CPU allocator reports to ``torch.profiler`` (``profile_memory=True``) between
  the start of the forward and the end of the backward (inputs and the incoming gradient are
  allocated before, so they are not counted; our kernels allocate their outputs with torch).
  ``peak_memory_ratio_beyond_output``: the same peaks less the expanded ``[N_b, D]`` output that
  both ways must return (the memory each way needs besides its result).
  ``peak_bytes_lower_bound``: what any implementation must allocate in forward + backward, the
  ``[N_b, D]`` output and the ``[N_u, D]`` gradient; ``peak_memory_ratio_reachable`` = the
  baseline's peak over it (the largest ``peak_memory_ratio`` any kernel could show against this
  baseline) and ``peak_ours_over_lower_bound`` = ours over it (1.0 = nothing allocated beyond).
* ``vs_fbgemm_jagged_index_select``: ``torch.ops.fbgemm.jagged_index_select`` time / ours, same
  inputs, forward + backward (``>= 1`` means ours is faster); forward only is reported as well.
* ``gpu`` (when torch sees a CUDA device, or ``--gpu simulate``): the Numba-CUDA forms of
  ``jagged_index_select``, ``jagged_index_add``, ``segment_reduce`` (sum) and ``dedup_rows`` on
  one batch, timed with CUDA events; achieved GB/s = logical bytes (each input element read and
  each output element written once) / time, as a share of the device's peak (2 x memory clock x
  bus width, from Numba) and against a ``torch`` device-to-device copy of the select's output size.
  ``gpu_sweep`` (``--gpu-rows 4096,16384,...``): the same section again at each batch size, to
  tell a kernel's fixed cost per call (launch, argument conversion, host sync) from its bandwidth.
  The select is timed three ways (``known_layout_note`` in the JSON): as a caller that passes
  nothing makes it (``jagged_index_select``: output offsets on the device and one sync for the
  size), passing the size the host counted (``_known_size``) and passing the batch's offsets as
  well (``_known_layout``); and each select and add kernel alone in each thread layout of
  ``recpipe.kernels.cuda`` (``select_kernel_word``, ``select_kernel_row``, ``add_kernel_word``,
  ``add_kernel_row``, ``add_kernel_run``). The calls that read nothing back are also timed as
  the device runs them (``<name>_device_ms``, ``<name>_device_vs_torch_copy``): the device sleeps
  while the host queues the call, so the host's launch work is hidden; the difference from
  ``<name>_ms`` is what the host adds to every call.

Run: ``python -m benchmarks.kernels [--rows 4096] [--batches 20] [--dim 64]``; writes
``benchmarks/results/kernels.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import Timing, alternate, int_list, ratio_spread, spread, timing_ratio
from recpipe.kernels import dedup_rows, jagged_index_select

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernels.json"


# --------------------------------------------------------------------------------------------
# data


def session_batch(
    rng: np.random.Generator,
    *,
    rows: int,
    keys: int,
    session_rows: int,
    min_len: int,
    max_len: int,
    change_prob: float = 0.1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One batch: per key ``(values int64 [N], offsets int64 [rows + 1])``."""
    sizes = []
    while sum(sizes) < rows:
        sizes.append(int(rng.integers(1, 2 * session_rows)))
    sizes[-1] -= sum(sizes) - rows
    per_key: list[list[np.ndarray]] = [[] for _ in range(keys)]
    for size in sizes:  # data generation only: Python over sessions is fine here
        for k in range(keys):
            current = rng.integers(0, 10**9, int(rng.integers(min_len, max_len + 1)))
            for _ in range(size):
                if k > 0 and rng.random() < change_prob:
                    current = rng.integers(0, 10**9, int(rng.integers(min_len, max_len + 1)))
                per_key[k].append(current)
    out = []
    for lists in per_key:
        lengths = np.array([len(x) for x in lists], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out.append((np.concatenate(lists).astype(np.int64), offsets))
    return out


def batch_shape(args: argparse.Namespace) -> dict[str, int]:
    """The :func:`session_batch` arguments given on the command line."""
    return {
        "rows": args.rows,
        "session_rows": args.session_rows,
        "min_len": args.min_len,
        "max_len": args.max_len,
    }


def unique_offsets(
    offsets: torch.Tensor, unique_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets, lengths)`` of the unique rows' lists, on ``offsets``' device."""
    lengths = (offsets[1:] - offsets[:-1])[unique_rows]
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=offsets.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out, lengths


# --------------------------------------------------------------------------------------------
# baselines


_MULTS = np.random.default_rng(0).integers(1, 2**63, 4096, dtype=np.uint64) | np.uint64(1)


def numpy_dedup(batch: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised row hash (sum of id * position multiplier) + ``np.unique``; no verification."""
    num_rows = batch[0][1].shape[0] - 1
    h = np.zeros(num_rows, np.uint64)
    for k, (values, offsets) in enumerate(batch):
        lengths = np.diff(offsets)
        pos = np.arange(values.shape[0]) - np.repeat(offsets[:-1], lengths)
        terms = values.astype(np.uint64) * _MULTS[pos % _MULTS.shape[0]]
        key_hash = np.add.reduceat(terms, offsets[:-1]) if values.shape[0] else terms
        h = h * _MULTS[k + 1] + key_hash + lengths.astype(np.uint64) * _MULTS[0]
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    return first[order], rank[inverse]


def torch_dedup(
    batch: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every key's rows to dense (with the length in front), ``torch.unique(dim=0)``."""
    blocks = []
    for values, offsets in batch:
        lengths = offsets[1:] - offsets[:-1]
        width = int(lengths.max()) if lengths.numel() else 0
        dense = torch.full((lengths.shape[0], width), -1, dtype=values.dtype)
        dense[torch.arange(width) < lengths[:, None]] = values
        blocks += [lengths[:, None], dense]
    rows = torch.cat(blocks, dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), rows.shape[0], dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(rows.shape[0]), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0])
    return first[order], rank[inverse]


def dense_index_select(
    values: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """The pre-RecD way: jagged -> padded dense ``[U, L, D]`` -> index_select -> jagged."""
    lengths = offsets[1:] - offsets[:-1]
    width = int(lengths.max())
    mask = torch.arange(width) < lengths[:, None]  # (U, L)
    dense = values.new_zeros(lengths.shape[0], width, values.shape[1])  # (U, L, D)
    dense = dense.masked_scatter(mask[:, :, None], values)
    picked = dense.index_select(0, indices)  # (B, L, D)
    return picked[mask.index_select(0, indices)]  # (N_b, D)


# --------------------------------------------------------------------------------------------
# measuring


def median_times(runs: dict[str, list[Timing]]) -> dict[str, float]:
    """Median wall seconds per call of each case of :func:`_common.alternate`."""
    return {name: statistics.median(t.wall_s for t in ts) for name, ts in runs.items()}


def rate_spread(runs: list[Timing], units: float) -> dict[str, Any]:
    """Spread of ``units`` per wall second over the repeats."""
    return spread([units / t.wall_s for t in runs])


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of the running sum of torch CPU allocations/frees while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    ]
    events.sort()
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def _require(ok: bool, what: str) -> None:
    if not ok:
        msg = f"{what} disagrees with recpipe's kernels on the same batch; not timing it"
        raise RuntimeError(msg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(args.seed)
    shape = batch_shape(args)
    one = [session_batch(rng, keys=1, **shape) for _ in range(args.batches)]
    three = [session_batch(rng, keys=3, **shape) for _ in range(args.batches)]
    to_torch = [
        [[(torch.from_numpy(v), torch.from_numpy(o)) for v, o in b] for b in bs]
        for bs in (one, three)
    ]
    one_t, three_t = to_torch
    total_rows = args.rows * args.batches

    def ours(batches):
        return lambda: [dedup_rows([v for v, _ in b], [o for _, o in b]) for b in batches]

    # Correctness of the baselines on the first batch (they are only timed if they agree).
    for b, bt in ((one[0], one_t[0]), (three[0], three_t[0])):
        want = dedup_rows([v for v, _ in bt], [o for _, o in bt])
        for got in (numpy_dedup(b), torch_dedup(bt)):
            _require(np.array_equal(np.asarray(got[1]), want[1].numpy()), "a dedup baseline")
    dedup_factor = statistics.mean(
        args.rows / dedup_rows([b[0][0]], [b[0][1]])[0].shape[0] for b in one_t
    )
    dedup_factor_3 = statistics.mean(
        args.rows / dedup_rows([v for v, _ in b], [o for _, o in b])[0].shape[0] for b in three_t
    )
    torch_batches = one_t[: max(1, args.batches // 4)]  # torch.unique is slow: fewer batches
    torch_rows = args.rows * len(torch_batches)
    dedup_runs = alternate(
        {
            "ours": ours(one_t),
            "ours_warm": ours(one_t[:1] * args.batches),
            "ours3": ours(three_t),
            "numpy": lambda: [numpy_dedup(b) for b in one],
            "numpy3": lambda: [numpy_dedup(b) for b in three],
            "torch": lambda: [torch_dedup(b) for b in torch_batches],
        },
        repeats=args.repeats,
    )
    t = median_times(dedup_runs)

    # Jagged index select: expand the unique rows' embeddings [N_u, D] to the batch.
    values_b, offsets_b = one_t[0][0]
    unique_rows, inverse = dedup_rows([values_b], [offsets_b])
    offsets_u, lengths_u = unique_offsets(offsets_b, unique_rows)
    emb = torch.randn(int(offsets_u[-1]), args.dim, requires_grad=True)
    grad = torch.randn(int(offsets_b[-1]), args.dim)

    def ours_select():
        out, _ = jagged_index_select(emb, offsets_u, inverse)
        out.backward(grad)
        emb.grad = None

    def dense_select():
        out = dense_index_select(emb, offsets_u, inverse)
        out.backward(grad)
        emb.grad = None

    def fbgemm_select():
        out = torch.ops.fbgemm.jagged_index_select(emb, lengths_u, inverse)[0]
        out.backward(grad)
        emb.grad = None

    with torch.no_grad():
        want = jagged_index_select(emb, offsets_u, inverse)[0]
        _require(torch.equal(dense_index_select(emb, offsets_u, inverse), want), "the dense select")
    select_fns = {"ours": ours_select, "dense": dense_select}
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        with torch.no_grad():
            fb_out = torch.ops.fbgemm.jagged_index_select(emb, lengths_u, inverse)[0]
            _require(torch.equal(fb_out, want), "fbgemm's jagged_index_select")
        select_fns["fbgemm"] = fbgemm_select
        fbgemm_error = None
    except ImportError as exc:
        fbgemm_error = f"fbgemm_gpu not importable: {exc}"
    select_runs = alternate(select_fns, repeats=args.repeats * 3)
    ts = median_times(select_runs)
    peak_ours, peak_dense = peak_bytes(ours_select), peak_bytes(dense_select)
    out_bytes = grad.numel() * grad.element_size()  # the [N_b, D] output, the same size as grad
    # What any implementation must allocate in forward + backward: the output and the [N_u, D]
    # gradient of the unique rows (inputs and the incoming gradient exist before).
    bound_bytes = out_bytes + emb.numel() * emb.element_size()
    result: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out)},
        "machine": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "numba": numba.__version__,
            "platform": platform.platform(),
        },
        "dedup_factor": round(dedup_factor, 3),
        "dedup_factor_3_features": round(dedup_factor_3, 3),
        "dedup_rows_per_s": total_rows / t["ours"],
        "dedup_rows_per_s_spread": rate_spread(dedup_runs["ours"], total_rows),
        "dedup_rows_per_s_3_features_spread": rate_spread(dedup_runs["ours3"], total_rows),
        "dedup_rows_per_s_warm_cache": total_rows / t["ours_warm"],
        "dedup_rows_per_s_3_features": total_rows / t["ours3"],
        "numpy_unique_rows_per_s": total_rows / t["numpy"],
        "numpy_unique_rows_per_s_3_features": total_rows / t["numpy3"],
        "torch_unique_rows_per_s": torch_rows / t["torch"],
        "dedup_speedup_vs_numpy_spread": timing_ratio(dedup_runs, "ours", "numpy", per="rate"),
        "jagged_index_select_ms": ts["ours"] * 1e3,
        "dense_index_select_ms": ts["dense"] * 1e3,
        "jagged_index_select_speedup_spread": timing_ratio(
            select_runs, "ours", "dense", per="rate"
        ),
        "peak_bytes_ours": peak_ours,
        "peak_bytes_dense": peak_dense,
        "peak_memory_ratio": peak_dense / max(peak_ours, 1),
        "peak_bytes_output": out_bytes,
        "peak_memory_ratio_beyond_output": (peak_dense - out_bytes) / max(peak_ours - out_bytes, 1),
        "peak_bytes_lower_bound": bound_bytes,
        "peak_memory_ratio_reachable": peak_dense / bound_bytes,
        "peak_ours_over_lower_bound": peak_ours / bound_bytes,
    }
    for key in ("dedup_speedup_vs_numpy", "jagged_index_select_speedup"):
        result[key] = result[f"{key}_spread"]["median"]  # the median of the paired ratios
    if fbgemm_error is None:
        with torch.no_grad():
            forward_runs = alternate(
                {
                    "ours": lambda: jagged_index_select(emb, offsets_u, inverse),
                    "fbgemm": lambda: torch.ops.fbgemm.jagged_index_select(emb, lengths_u, inverse),
                },
                repeats=args.repeats * 3,
            )
        result |= {
            "fbgemm_jagged_index_select_ms": ts["fbgemm"] * 1e3,
            "vs_fbgemm_jagged_index_select_spread": timing_ratio(
                select_runs, "ours", "fbgemm", per="rate"
            ),
            "vs_fbgemm_jagged_index_select_forward_spread": timing_ratio(
                forward_runs, "ours", "fbgemm", per="rate"
            ),
        }
        for key in ("vs_fbgemm_jagged_index_select", "vs_fbgemm_jagged_index_select_forward"):
            result[key] = result[f"{key}_spread"]["median"]
    else:
        result |= {"vs_fbgemm_jagged_index_select": None, "fbgemm_skipped": fbgemm_error}
    return result


# --------------------------------------------------------------------------------------------
# GPU: achieved bandwidth of the Numba-CUDA kernels


def peak_bandwidth_gbps() -> float | None:
    """The device's peak memory bandwidth in GB/s from its memory clock and bus width.

    ``2 * memory clock * bus width / 8`` (double data rate); ``None`` where the device does not
    report them (Numba's simulator).
    """
    from numba import cuda

    dev = cuda.get_current_device()
    try:
        clock_khz = dev.MEMORY_CLOCK_RATE
        bus_bits = dev.GLOBAL_MEMORY_BUS_WIDTH
    except AttributeError:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def _device_timer(device: torch.device) -> Callable[[Callable[[], Any], int], list[float]]:
    """Seconds of each of ``repeats`` calls: CUDA events on a GPU, ``perf_counter`` in the
    simulator."""

    def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
        fn()  # warm-up: compilation and the caching allocator
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize(device)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times

    return timed


def run_gpu(args: argparse.Namespace, *, simulate: bool = False) -> dict[str, Any]:
    """Achieved bandwidth of the CUDA kernels, as a share of peak and of ``torch`` copy.

    Bytes are the logical traffic of each kernel: every input element it must read and every
    output element it writes, once (what a perfect kernel moves); repeated reads served by
    caches are not counted again. ``simulate``: CPU tensors through Numba's simulator, tiny
    sizes only, to check this code path without a GPU (its rates mean nothing).
    """
    from recpipe.kernels import cuda as kc
    from recpipe.kernels.cpu import jagged_index_add as cpu_index_add

    if simulate:
        if not kc.is_simulator():
            raise SystemExit("--gpu simulate needs NUMBA_ENABLE_CUDASIM=1 in the environment")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        return {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
    rng = np.random.default_rng(args.seed)
    shape = batch_shape(args)
    ids_np, offsets_np = session_batch(rng, keys=1, **shape)[0]
    ids = torch.from_numpy(ids_np).to(device)
    offsets_b = torch.from_numpy(offsets_np).to(device)
    unique_rows, inverse = kc.dedup_rows([ids], [offsets_b])
    offsets_u, _ = unique_offsets(offsets_b, unique_rows)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    emb = torch.randn(int(offsets_u[-1]), args.dim, generator=gen, device=device)
    out, out_offsets = kc.jagged_index_select(emb, offsets_u, inverse)
    want = dense_index_select(emb.cpu(), offsets_u.cpu(), inverse.cpu())
    _require(torch.equal(out.cpu(), want), "the CUDA jagged_index_select")
    # what a caller holding the deduplicated batch knows without the device: the expanded rows
    # are the batch's rows, so their offsets are the batch's (copied with it) and their number
    # of values was counted on the host before the copy
    known = {"out_offsets": offsets_b, "num_out_values": int(offsets_np[-1])}
    got = kc.jagged_index_select(emb, offsets_u, inverse, **known)[0]
    _require(torch.equal(got.cpu(), want), "the CUDA jagged_index_select given the batch's offsets")
    grad = torch.randn(out.shape, generator=gen, device=device)
    want_grad = cpu_index_add(
        grad.cpu(), out_offsets.cpu(), offsets_u.cpu(), inverse.cpu(), len(emb)
    )
    for layout in _SELECT_LAYOUTS:
        got = torch.full_like(out, float("nan"))
        kc.select_into(emb, offsets_u, inverse, out_offsets, got, layout=layout)
        _require(torch.equal(got.cpu(), want), f"the CUDA select's {layout!r} kernel")
    for layout in _ADD_LAYOUTS:
        got = torch.zeros_like(emb)
        kc.add_into(grad, out_offsets, offsets_u, inverse, got, layout=layout)
        _require(
            torch.allclose(got.cpu(), want_grad, rtol=1e-5, atol=1e-5),
            f"the CUDA add's {layout!r} kernel",
        )
    n_u, n_b, width = emb.numel(), out.numel(), 4  # float32 elements, bytes per element
    rows_b, rows_u = inverse.shape[0], unique_rows.shape[0]
    copy_src = torch.empty(n_b, device=device)
    copy_dst = torch.empty_like(copy_src)
    acc = torch.zeros_like(emb)
    idx_bytes = 8 * (2 * rows_b + rows_u)  # indices, output offsets, source offsets
    select_bytes = 2 * n_b * width + idx_bytes  # reads every selected element, writes the output
    add_bytes = n_b * width + 2 * n_u * width + idx_bytes  # reads the gradient, zero-fills, writes
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        # the call as a caller that knows nothing makes it: output offsets, one sync for the size
        "jagged_index_select": (
            lambda: kc.jagged_index_select(emb, offsets_u, inverse),
            select_bytes,
        ),
        # the call as a caller passing the size it counted on the host: no sync
        "jagged_index_select_known_size": (
            lambda: kc.jagged_index_select(
                emb, offsets_u, inverse, num_out_values=known["num_out_values"]
            ),
            select_bytes,
        ),
        # the call as a caller passing the batch's offsets and size: no sync, no offsets
        "jagged_index_select_known_layout": (
            lambda: kc.jagged_index_select(emb, offsets_u, inverse, **known),
            select_bytes,
        ),
        "jagged_index_add": (
            lambda: kc.jagged_index_add(grad, out_offsets, offsets_u, inverse, emb.shape[0]),
            add_bytes,
        ),
        # each kernel alone, into outputs allocated once: the layouts of recpipe.kernels.cuda
        **{
            f"select_kernel_{layout}": (
                functools.partial(
                    kc.select_into, emb, offsets_u, inverse, out_offsets, out, layout=layout
                ),
                select_bytes,
            )
            for layout in _SELECT_LAYOUTS
        },
        **{
            f"add_kernel_{layout}": (
                functools.partial(
                    kc.add_into, grad, out_offsets, offsets_u, inverse, acc, layout=layout
                ),
                add_bytes - n_u * width,  # no zero-fill
            )
            for layout in _ADD_LAYOUTS
        },
        # reads the unique rows' embeddings, writes one [D] row per unique row
        "segment_reduce_sum": (
            lambda: kc.segment_reduce(emb, offsets_u, "sum"),
            n_u * width + rows_u * args.dim * width + 8 * rows_u,
        ),
        # reads the ids twice (hash, verify) and the offsets
        "dedup_rows": (
            lambda: kc.dedup_rows([ids], [offsets_b]),
            2 * ids.numel() * 8 + 8 * (rows_b + 1),
        ),
        # the practical ceiling: a device-to-device copy of the select's output size
        "torch_copy": (lambda: copy_dst.copy_(copy_src), 2 * n_b * width),
    }
    timed = _device_timer(device)
    repeats = max(3, args.repeats * 4)
    peak = peak_bandwidth_gbps() if not simulate else None
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "simulator",
        "simulated": simulate,
        "peak_bandwidth_gbps": peak,
        "rows": rows_b,
        "unique_rows": rows_u,
        "select_layout": kc.SELECT_LAYOUT,
        "add_layout": kc.ADD_LAYOUT,
        "known_layout_note": _KNOWN_LAYOUT_NOTE,
    }
    times: dict[str, list[float]] = {}
    for name, (fn, nbytes) in cases.items():
        times[name] = timed(fn, repeats)
        seconds = statistics.median(times[name])
        gbps = nbytes / seconds / 1e9
        result[f"{name}_bytes"] = nbytes
        result[f"{name}_ms"] = seconds * 1e3
        result[f"{name}_gbps"] = gbps
        result[f"{name}_share_of_peak"] = gbps / peak if peak else None
    if device.type == "cuda":  # the device's own time, the host's launch work hidden
        for name in (*_QUEUED_CASES, "torch_copy"):
            result[f"{name}_device_ms"] = (
                statistics.median(_queued_times(cases[name][0], repeats, device)) * 1e3
            )
        for name in _QUEUED_CASES:
            result[f"{name}_device_vs_torch_copy"] = (
                cases[name][1] / result[f"{name}_device_ms"]
            ) / (cases["torch_copy"][1] / result["torch_copy_device_ms"])
    for name, fn in _noop_launches(kc, [ids, offsets_b, inverse, emb]).items():
        result[f"{name}_ms"] = statistics.median(timed(fn, repeats)) * 1e3
    copy_gbps = result["torch_copy_gbps"]
    copy_bytes = cases["torch_copy"][1]
    for name, (_, nbytes) in cases.items():
        if name != "torch_copy":
            result[f"{name}_vs_torch_copy"] = result[f"{name}_gbps"] / copy_gbps
            # repeat i of the kernel against repeat i of the copy: rate over rate
            result[f"{name}_vs_torch_copy_spread"] = ratio_spread(
                [nbytes / t for t in times[name]], [copy_bytes / c for c in times["torch_copy"]]
            )
    return result


def _queued_times(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` as the device runs them: the device sleeps
    (about a millisecond) while the host queues the call's launches behind it, so the events
    time the kernels and the gaps between them, not the host's work to launch them. Only for
    calls that read nothing back (a read would wait for the sleep)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(2_000_000)  # cycles
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _noop_launches(kc: Any, tensors: list[Any]) -> dict[str, Callable[[], Any]]:
    """One launch of a Numba-CUDA kernel that does nothing on ``tensors``: through Numba's
    dispatcher (``dispatcher_launch``) and as the CUDA forms launch (``direct_launch``); the
    host-side cost a kernel adds to every call."""
    from numba import cuda

    @cuda.jit
    def noop(a, b, c, d):
        pass

    device = tensors[0].device

    def dispatcher() -> None:
        noop[1, 32, kc.torch_stream(device)](*(kc.as_device_array(t) for t in tensors))

    return {
        "dispatcher_launch": dispatcher,
        "direct_launch": lambda: kc.launch(noop, 1, 32, device, *tensors),
    }


_SELECT_LAYOUTS = ("word", "row")
_ADD_LAYOUTS = ("word", "row", "run")
_QUEUED_CASES = (  # the calls that read nothing back: their device time is measured too
    "jagged_index_select_known_size",
    "jagged_index_select_known_layout",
    "jagged_index_add",
    "select_kernel_row",
    "add_kernel_row",
    "add_kernel_run",
)
_GPU_CASES = (
    "jagged_index_select",
    "jagged_index_select_known_size",
    "jagged_index_select_known_layout",
    "jagged_index_add",
    "select_kernel_word",
    "select_kernel_row",
    "add_kernel_word",
    "add_kernel_row",
    "add_kernel_run",
    "segment_reduce_sum",
    "dedup_rows",
)
_KNOWN_LAYOUT_NOTE = (
    "jagged_index_select: the output offsets computed on the device and its size read back "
    "(one sync), as for a caller that passes nothing; _known_size: num_out_values passed (the "
    "batch's value count, known on the host before the copy), no sync; _known_layout: "
    "out_offsets (the batch's offsets, which the expanded rows share) and num_out_values "
    "passed; select_kernel_<layout> / add_kernel_<layout>: the kernels alone into outputs "
    "allocated once (add: no zero-fill), layout 'word' = a thread per word, 'row' = a warp "
    "(select) or block (add) per row, 'run' (add) = a block per run of equal indices, summed "
    "before one atomic add; select_layout / add_layout: the ones the calls above used; "
    "<name>_device_ms: the device's time for the call, the host's launch work hidden"
)


def print_table(result: dict[str, Any]) -> None:
    targets = {
        "dedup_rows_per_s": ">= 8e6",
        "jagged_index_select_speedup": ">= 3",
        "peak_memory_ratio": f">= {result['dedup_factor']:.1f} (dedup factor)",
        "vs_fbgemm_jagged_index_select": ">= 1",
    }
    print(f"{'figure':<40} {'value':>14}  target")
    for key, value in result.items():
        if key in ("config", "machine", "gpu") or key.endswith("_spread"):
            continue
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        s = result.get(f"{key}_spread")
        s = s.get("wall", s) if isinstance(s, dict) else None
        span = f"  [{s['min']:,.3f} .. {s['max']:,.3f}]" if s else ""
        print(f"{key:<40} {shown:>14}  {targets.get(key, '')}{span}")
    gpu = result.get("gpu")
    if gpu is None:
        return
    if "skipped" in gpu:
        print(f"gpu: skipped ({gpu['skipped']})")
        return
    peak = gpu["peak_bandwidth_gbps"]
    print(f"gpu: {gpu['device']}, peak {peak:,.0f} GB/s" if peak else f"gpu: {gpu['device']}")
    print(f"{'kernel':<24} {'ms':>10} {'GB/s':>10} {'of peak':>8} {'vs copy':>8}")
    for name in _GPU_CASES:
        share = gpu[f"{name}_share_of_peak"]
        print(
            f"{name:<24} {gpu[f'{name}_ms']:>10.3f} {gpu[f'{name}_gbps']:>10.1f} "
            f"{(f'{share:.0%}' if share is not None else '-'):>8} "
            f"{gpu[f'{name}_vs_torch_copy']:>8.2f}"
        )
    if result.get("gpu_sweep"):
        print("share of peak (ms) by batch rows:")
        for point in result["gpu_sweep"]:
            cells = [
                f"{name} {point[f'{name}_ms']:.3f} ms"
                + (f" {share:.1%}" if (share := point[f"{name}_share_of_peak"]) is not None else "")
                for name in (*_GPU_CASES, "torch_copy")
            ]
            print(f"  {point['rows']:>8,}: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--rows", type=int, default=4096, help="rows per batch (default 4096)")
    parser.add_argument("--batches", type=int, default=20, help="batches per timing (default 20)")
    parser.add_argument(
        "--session-rows",
        type=int,
        default=5,
        help="mean rows per session ~ dedup factor (default 5)",
    )
    parser.add_argument("--min-len", type=int, default=20, help="shortest list (default 20)")
    parser.add_argument("--max-len", type=int, default=50, help="longest list (default 50)")
    parser.add_argument(
        "--dim", type=int, default=64, help="embedding width for the select (default 64)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats, the median is kept (default 5)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch and Numba threads (default 1: per core)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gpu",
        choices=["auto", "off", "simulate"],
        default="auto",
        help="CUDA bandwidth figures: auto = when torch sees a GPU; simulate = through Numba's "
        "simulator (needs NUMBA_ENABLE_CUDASIM=1; checks the code path, rates mean nothing)",
    )
    parser.add_argument(
        "--gpu-rows",
        type=functools.partial(int_list, minimum=1, example="4096,16384"),
        default=(),
        metavar="ROWS",
        help="also time the GPU section at these batch sizes, comma-separated (e.g. "
        "4096,16384,65536,131072): `gpu_sweep` in the JSON",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    result = run(args)
    if args.gpu != "off":
        simulate = args.gpu == "simulate"
        result["gpu"] = run_gpu(args, simulate=simulate)
        if args.gpu_rows and "skipped" not in result["gpu"]:
            result["gpu_sweep"] = [
                run_gpu(argparse.Namespace(**{**vars(args), "rows": rows}), simulate=simulate)
                for rows in args.gpu_rows
            ]
            # each kernel's rate / a copy's, by batch rows (the report's per-size rows)
            result["gpu_sweep_vs_torch_copy"] = {
                str(point["rows"]): {
                    name: point[f"{name}_vs_torch_copy_spread"] for name in _GPU_CASES
                }
                for point in result["gpu_sweep"]
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
