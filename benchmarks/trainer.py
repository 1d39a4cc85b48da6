"""Trainer throughput and memory, dedup on vs off, and our embedding path vs TorchRec's.

Generates the default synthetic logs (`etl.synth.generate`), builds the clustered dataset
(`etl.build.build`), reads the same batches twice through the readers (with IKJTs per dedup group,
and as one plain KJT), and trains the same DLRM (attention-pooled user history: liked items +
liked sellers) on both. Every figure is a ratio of two measurements taken in this run: both ways
take the same untimed warm-up, then steps alternate on/off with the order rotating each step,
timed in CPU seconds of this process (`time.process_time`, torch on `--threads` threads; wall
time beside it), and the median of the paired per-step ratios is kept, its spread written beside
it (`<figure>_spread`), so other load on the machine matters little.

Figures (written to benchmarks/results/trainer.json):
  dedup_speedup            training samples/s with dedup on / off (forward + backward + optimizer
                           step; batches preloaded, so reading is not timed). Target >= 2.5.
                           "off" is the no-dedup compute: every batch row through the embeddings
                           and the attention layers (`DLRM.set_dedup_groups(())`).
  losses_equal_bitwise     `recpipe train --dedup off` (plain batches, deduplicated by the model
                           as the readers do) against dedup on: the per-step losses of the same
                           batches equal as floats, for each optimizer (sgd, adagrad, adam;
                           `losses_equal_bitwise_by_optimizer`) over `--bitwise-steps` steps
                           (the loaded batches in turn).
                           Target: true on the CPU (on a GPU the float atomics that sum the
                           duplicate rows' gradients may part them: docs/gpu.md).
  activation_memory_ratio  bytes of the embedding and attention activations, off / on. Measured
                           with `torch.autograd.graph.saved_tensors_hooks`: every tensor saved for
                           backward while the embedding-bag, sequence-embedding and attention
                           modules run (parameters excluded, each storage counted once), plus
                           those modules' outputs. Reported next to the measured dedup factors.
  max_batch_ratio          largest batch whose activations fit `--memory-budget-mib`, on / off.
                           Computed from the measured bytes saved for backward by the whole
                           forward pass per sample at `--batch-size` (activations grow linearly
                           in B), not by trying batch sizes until one fails.
  vs_torchrec_ebc          our plain (no-dedup) PooledEmbeddings / TorchRec's
                           `EmbeddingBagCollection` (torchrec 1.8.0 + fbgemm-gpu-cpu), same
                           tables, same weights, same plain batches, forward + backward with dense
                           gradients as TorchRec has; forward-only and our default sparse-gradient
                           path are reported too. Target >= 1.0.
  end_to_end_vs_model_only (``--end-to-end``; on a GPU) training samples/s when the readers feed
                           the model (DataLoader workers reading the clustered dataset, batches
                           pinned and copied non-blocking) / the same model on batches already
                           on the device; per worker count (``--workers``), wall time, rounds
                           alternating the two. Target >= 0.9 with the workers it took.
  torchrec_swap_dedup_speedup
                           a TorchRec model's embedding step after the one-import swap
                           (`trainer.torchrec.EmbeddingBagCollection` on the deduplicated batches:
                           IKJT groups pooled on their unique rows) / TorchRec's
                           `EmbeddingBagCollection` on the same rows as plain KJTs; same tables,
                           same weights, forward + backward with dense gradients. Report only;
                           `torchrec_swap_plain` is the swapped module on the plain KJTs (~1).
  partial_speedup          the shifted-history feature of the schema's ``[dedup] partial`` (synth:
                           user_recent_items) read as a partial IKJT (its packed ids looked up
                           once, RecD §7) / the same batches with it expanded into the plain KJT
                           (every other group unchanged): training samples/s, steps alternated as
                           for dedup_speedup. `partial_dedup_factor` is its ids expanded /
                           stored in these batches; `partial_embedding_speedup` times that
                           feature's pooled embedding alone (forward + backward), partial /
                           expanded. Report only.
  default_threads_vs_one   training samples/s (wall time) with `recpipe train`'s default
                           `--threads` (`trainer.config.default_threads`: the cores free for the
                           process, which on a loaded box is 1) / with 1 thread (as
                           `OMP_NUM_THREADS=1`): one model, the
                           thread count switched before each step, the order rotating each step,
                           dedup-on batches. Target >= 0.95 (the default must not be slower
                           than one thread on a shared box). `--threads-only` measures it alone.
  exact_dense_vs_fast      training samples/s (CPU time) of `recpipe train`'s default dense
                           gradients (float64 sums over the rows, rounded once: what makes one
                           process and N ranks train the same model) / `--fast-dense` (torch's
                           float32 autograd): two copies of one model, steps alternated on the
                           same dedup-on batches. Report only (the price of exactness).
                           `--exact-only` measures it alone and updates it in the results file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import (
    Timing,
    int_list,
    partial_schema,
    ratio_spread,
    timed,
    timing_ratio,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "trainer.json"

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200_000, help="synthetic requests")
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table")
    parser.add_argument(
        "--memory-budget-mib", type=float, default=4096.0, help="activation budget (max batch)"
    )
    parser.add_argument("--ebc-batches", type=int, default=10, help="batches for vs_torchrec_ebc")
    parser.add_argument("--data", type=Path, help="an existing clustered dataset (skip synth)")
    parser.add_argument("--work", type=Path, help="working directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (reported separately)")
    parser.add_argument(
        "--end-to-end", action="store_true",
        help="also time training fed by the readers against preloaded batches",
    )  # fmt: skip
    parser.add_argument(
        "--end-to-end-data", type=Path, default=None,
        help="the clustered dataset --end-to-end reads (default: --data). Give each worker "
        "several row groups an epoch: a worker that reads one row group an epoch pays a "
        "split's start for every batch",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=functools.partial(int_list, minimum=0, example="4,8"), default=(2,),
        help="DataLoader worker counts for --end-to-end, comma-separated (default 2)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="--end-to-end rounds per count")
    parser.add_argument(
        "--fed-transport", choices=("packed", "tensors", "both"), default="packed",
        help="how --end-to-end's workers send a batch: packed in one buffer (the loader's "
        "default), tensor by tensor, or both ways alternated in the same rounds",
    )  # fmt: skip
    parser.add_argument(
        "--epochs-ahead", action=argparse.BooleanOptionalAction, default=True,
        help="--end-to-end's workers read on into the next epoch (make_dataloader's "
        "epochs_ahead; default on): no pause at each epoch's end (off: workers start afresh "
        "each epoch)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-grads", action="store_true",
        help="dense embedding gradients (ModelConfig.sparse_grad=False): on a GPU the sparse "
        "optimizer step reads sizes back from the device several times per table",
    )  # fmt: skip
    parser.add_argument(
        "--threads-only", action="store_true",
        help="measure default_threads_vs_one alone (and --threads-steps of it)",
    )  # fmt: skip
    parser.add_argument(
        "--exact-only", action="store_true",
        help="measure exact_dense_vs_fast alone (--threads-steps of it) and update it in --out",
    )  # fmt: skip
    parser.add_argument(
        "--threads-steps", type=int, default=20,
        help="timed steps per side, default_threads_vs_one and exact_dense_vs_fast",
    )  # fmt: skip
    parser.add_argument(
        "--bitwise-steps", type=int, default=30,
        help="steps per optimizer and side of the losses_equal_bitwise check",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    return parser.parse_args(argv)


# -- data ---------------------------------------------------------------------------------------
def build_dataset(work: Path, *, requests: int, seed: int) -> tuple[Path, dict[str, Any]]:
    """Synthetic logs -> the clustered dataset; returns its path and the generator summary."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed), progress=True)
    out = work / "clustered"
    build(
        logs.features, out, events=logs.events, schema=partial_schema(),
        config=BuildConfig(), overwrite=True, progress=True,
    )  # fmt: skip
    synth = json.loads((work / "raw" / "_synth.json").read_text())
    return out, synth


def load_batches(dataset: Path, *, batch_size: int, count: int, dedup: bool) -> list[Any]:
    """The first ``count`` full batches of the dataset (shuffled sessions, fixed seed)."""
    from readers.dataset import ParquetBatchDataset
    from readers.source import ReaderConfig

    config = ReaderConfig(batch_size=batch_size, shuffle=True, seed=1, last_batch="drop")
    batches = []
    for batch in ParquetBatchDataset(str(dataset), config=config, dedup=dedup):
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


# -- measurements -------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any], device: Any) -> Timing:
    """Wall and process-CPU seconds of ``fn`` (the device synchronised around it on CUDA)."""
    import torch

    if device.type != "cuda":
        return timed(fn)

    def synchronised() -> Any:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    torch.cuda.synchronize(device)
    return timed(synchronised)


def _rotated(names: list[str], repeat: int) -> list[str]:
    """``names`` in the order of repeat ``repeat``: rotated by one each repeat (as ``alternate``)."""
    k = repeat % len(names)
    return names[k:] + names[:k]


def _ratio(times: dict[str, list[Timing]], a: str, b: str, device: Any) -> dict[str, Any]:
    """How many times faster ``a`` is than ``b``, paired repeat by repeat; the headline is the
    CPU-time ratio on a CPU device (wall time on a GPU)."""
    ratio = timing_ratio(times, a, b, per="rate")
    return {**ratio, "headline": "cpu" if device.type == "cpu" else "wall"}


def _headline(ratio: dict[str, Any]) -> float:
    return ratio[ratio["headline"]]["median"]


def measure_speedup(
    schema: Any, on: list[Any], off: list[Any], *, model_config: Any, warmup: int, device: Any
) -> dict[str, Any]:
    """Alternate training steps of two identical models on the dedup and the plain batches.

    Both modes take the same ``warmup`` untimed steps; then step ``i`` of each mode runs on the
    same rows, the mode that goes first alternating from step to step.
    """
    from trainer.models import DLRM
    from trainer.train import Trainer

    models = {mode: DLRM.from_schema(schema, model_config) for mode in ("on", "off")}
    models["off"].set_dedup_groups(())  # every row of the plain batches: the no-dedup compute
    trainers = {mode: Trainer(model, device=device) for mode, model in models.items()}
    batches = {"on": on, "off": off}
    times: dict[str, list[Timing]] = {"on": [], "off": []}
    losses: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(min(len(on), len(off))):
        for mode in _rotated(["on", "off"], i):
            batch = batches[mode][i].to(device)
            t = _timed(lambda tr=trainers[mode], b=batch: tr.train_step(b), device)
            losses[mode].append(float(t.value[0]))
            if i >= warmup:
                times[mode].append(t)
            print(f"  step {i} dedup {mode:3s} {t.cpu_s * 1000:9.1f} ms CPU  loss "
                  f"{losses[mode][-1]:.5f}", file=sys.stderr)  # fmt: skip
    rows = on[0].batch_size
    kind = "cpu_s" if device.type == "cpu" else "wall_s"
    step_s = {m: statistics.median(getattr(t, kind) for t in times[m]) for m in times}
    ratio = _ratio(times, "on", "off", device)
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["on"], losses["off"]))
    return {
        "dedup_speedup": _headline(ratio),
        "dedup_speedup_spread": ratio,
        "samples_per_s_on": rows / step_s["on"],
        "samples_per_s_off": rows / step_s["off"],
        "median_step_s_on": step_s["on"],
        "median_step_s_off": step_s["off"],
        "timed_steps": len(times["on"]),
        "max_loss_rel_diff_on_vs_off": rel,
    }


def measure_bitwise(
    schema: Any, on: list[Any], off: list[Any], *, model_config: Any, steps: int, device: Any
) -> dict[str, Any]:
    """Dedup on against ``recpipe train --dedup off`` (the model deduplicates the plain batches'
    groups as the readers do): per-step losses equal as floats, per optimizer, over ``steps``
    steps on the batches in turn (an adaptive optimizer parts them only after a few steps)."""
    from trainer.config import OPTIMIZERS
    from trainer.models import DLRM
    from trainer.train import Trainer

    same = {}
    for optimizer in OPTIMIZERS:
        losses = {}
        for mode, batches in (("on", on), ("off", off)):
            model = DLRM.from_schema(schema, model_config)
            trainer = Trainer(model, optimizer=optimizer, device=device)
            losses[mode] = [
                float(trainer.train_step(batches[i % len(batches)].to(device))[0])
                for i in range(steps)
            ]
        same[optimizer] = losses["on"] == losses["off"]
        print(f"  {optimizer}: losses on == off over {steps} steps: {same[optimizer]}",
              file=sys.stderr)  # fmt: skip
    return {
        "losses_equal_bitwise": all(same.values()),
        "losses_equal_bitwise_by_optimizer": same,
        "bitwise_steps": steps,
    }


def measure_threads(
    schema: Any, batches: list[Any], *, model_config: Any, steps: int, warmup: int, device: Any
) -> dict[str, Any]:
    """Training steps with the default ``--threads`` / with one thread, alternated.

    One model trains on ``batches`` in turn (they are reused when there are fewer than the
    steps); before each step the thread count is set to the side's, the side that goes first
    rotating from step to step. Wall time: threads trade CPU time for wall time.
    """
    import torch

    from trainer.config import default_threads
    from trainer.models import DLRM
    from trainer.train import Trainer

    sides = {"default": default_threads(), "one": 1}
    before = torch.get_num_threads()
    trainer = Trainer(DLRM.from_schema(schema, model_config), device=device)
    times: dict[str, list[Timing]] = {"default": [], "one": []}
    try:
        for i in range(warmup + steps):
            for side in _rotated(list(sides), i):
                torch.set_num_threads(sides[side])
                batch = batches[(2 * i + (side == "one")) % len(batches)].to(device)
                t = _timed(lambda b=batch: trainer.train_step(b), device)
                if i >= warmup:
                    times[side].append(t)
                print(f"  step {i} threads {sides[side]:2d} {t.wall_s * 1000:9.1f} ms wall",
                      file=sys.stderr)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    ratio = timing_ratio(times, "default", "one", per="rate")
    rows = batches[0].batch_size
    wall = {m: statistics.median(t.wall_s for t in times[m]) for m in times}
    return {
        "default_threads_vs_one": ratio["wall"]["median"],
        "default_threads_vs_one_spread": ratio,
        "default_threads": sides["default"],
        "samples_per_s_default_threads": rows / wall["default"],
        "samples_per_s_one_thread": rows / wall["one"],
        "threads_timed_steps": steps,
    }


def measure_exact_dense(
    schema: Any, batches: list[Any], *, model_config: Any, steps: int, warmup: int, device: Any
) -> dict[str, Any]:
    """Training steps with exact dense gradients / with torch's float32 autograd, alternated
    (two copies of one model on the same batches, the side that goes first rotating)."""
    from trainer.models import DLRM
    from trainer.train import Trainer

    trainers = {side: Trainer(DLRM.from_schema(schema, model_config), device=device,
                              exact_dense=side == "exact") for side in ("exact", "fast")}  # fmt: skip
    times: dict[str, list[Timing]] = {"exact": [], "fast": []}
    for i in range(warmup + steps):
        batch = batches[i % len(batches)].to(device)
        for side in _rotated(list(trainers), i):
            t = _timed(lambda b=batch, tr=trainers[side]: tr.train_step(b), device)
            if i >= warmup:
                times[side].append(t)
    ratio = timing_ratio(times, "exact", "fast", per="rate")
    rows = batches[0].batch_size
    cpu = {m: statistics.median(t.cpu_s for t in times[m]) for m in times}
    return {
        "exact_dense_vs_fast": ratio["cpu"]["median"],
        "exact_dense_vs_fast_spread": ratio,
        "samples_per_s_exact_dense": rows / cpu["exact"],
        "samples_per_s_fast_dense": rows / cpu["fast"],
        "exact_dense_timed_steps": steps,
    }


def _without_partial(batch: Any) -> Any:
    """``batch`` with its partial IKJT groups expanded into the plain KJT."""
    from recpipe.ikjt import PartialInverseKeyedJaggedTensor
    from recpipe.jagged import KeyedJaggedTensor

    partial = [g for g in batch.ikjts.values() if isinstance(g, PartialInverseKeyedJaggedTensor)]
    ikjts = {
        n: g for n, g in batch.ikjts.items() if not isinstance(g, PartialInverseKeyedJaggedTensor)
    }
    kjt = KeyedJaggedTensor.concat([batch.kjt, *(g.to_kjt() for g in partial)])
    return dataclasses.replace(batch, kjt=kjt, ikjts=ikjts)


def measure_partial(
    schema: Any, on: list[Any], *, model_config: Any, warmup: int, device: Any
) -> dict[str, Any]:
    """Training and the partial feature's embedding step, partial IKJT vs expanded (see the
    module docstring: ``partial_speedup``); ``{}`` when the schema has no partial feature."""
    import torch

    from recpipe.ikjt import PartialInverseKeyedJaggedTensor
    from trainer.modules import PooledEmbeddings, TableConfig

    if not schema.dedup_partial:
        return {}
    expanded = [_without_partial(b) for b in on]
    train = measure_speedup(
        schema, on, expanded, model_config=model_config, warmup=warmup, device=device
    )
    groups = [
        g for b in on for g in b.ikjts.values() if isinstance(g, PartialInverseKeyedJaggedTensor)
    ]
    stored = sum(g.num_values for g in groups)
    factor = sum(g.num_expanded_values for g in groups) / max(stored, 1)
    features = tuple(schema.dedup_partial)
    table = TableConfig("partial", model_config.num_embeddings, model_config.embedding_dim,
                        features, hash_ids=True, sparse_grad=model_config.sparse_grad)  # fmt: skip
    ebc = PooledEmbeddings([table], seed=model_config.seed).to(device)

    def step(batch: Any) -> None:
        ebc.zero_grad(set_to_none=True)
        sum(v.sum() for v in ebc(batch).values()).backward()

    times: dict[str, list[Timing]] = {"partial": [], "expanded": []}
    for i, (p, e) in enumerate(zip(on, expanded, strict=True)):
        pair = {"partial": p.to(device), "expanded": e.to(device)}
        for mode in _rotated(["partial", "expanded"], i):
            t = _timed(lambda b=pair[mode]: step(b), device)
            if i >= warmup:
                times[mode].append(t)
    emb = _ratio(times, "partial", "expanded", device)
    with torch.no_grad():
        same = all(
            torch.equal(ebc(p.to(device))[f], ebc(e.to(device))[f])
            for p, e in zip(on, expanded, strict=True)
            for f in features
        )
    return {
        "partial_feature": list(features),
        "partial_dedup_factor": factor,
        "partial_speedup": train["dedup_speedup"],
        "partial_speedup_spread": train["dedup_speedup_spread"],
        "partial_samples_per_s": train["samples_per_s_on"],
        "partial_expanded_samples_per_s": train["samples_per_s_off"],
        "partial_max_loss_rel_diff": train["max_loss_rel_diff_on_vs_off"],
        "partial_embedding_speedup": _headline(emb),
        "partial_embedding_speedup_spread": emb,
        "partial_embedding_same_bags": same,
    }


def measure_end_to_end(
    dataset: Path, schema: Any, *, model_config: Any, args: argparse.Namespace, device: Any
) -> dict[str, Any]:
    """Training fed by the readers / the same training on batches already on the device.

    Each round trains ``warmup + steps`` steps on preloaded device batches, then as many fed by a
    fresh loader (``--workers`` DataLoader workers, pinned batches, non-blocking copies), the
    order swapping every round; only the last ``steps`` of each are timed (wall time, the device
    synchronised at both ends), and the fed side first takes two batches per worker, so worker
    start-up is not counted. The loader goes on into the
    next epoch when one ends (its workers persist), as a training run does. One model trains throughout
    (both ways run the same kernels on batches of the same shape).

    The workers send each batch packed in one buffer (``--fed-transport``: or tensor by tensor,
    or both alternated) and read on into the next epoch (``--epochs-ahead``; the benchmark's
    dataset is about a dozen batches an epoch, so a pause at each epoch's end would weigh). ``fed_next_share`` is the share of the fed side's timed wall time the
    training loop spent in ``next()`` (receiving, unpacking and the non-blocking copy; waiting
    for the workers too), ``fed_next_cpu_ms`` the main thread's CPU time per batch in it.
    """
    import time

    import torch

    from readers.dataset import make_dataloader
    from readers.source import ReaderConfig
    from trainer.models import DLRM
    from trainer.train import Trainer

    count, rows = args.warmup + args.steps, args.batch_size
    config = ReaderConfig(batch_size=rows, shuffle=True, seed=1, last_batch="drop")
    batches = load_batches(dataset, batch_size=rows, count=count, dedup=True)
    preloaded = [b.to(device) for b in batches]
    trainer = Trainer(DLRM.from_schema(schema, model_config), device=device)
    pin = device.type == "cuda"

    def rate(stream: Iterator[Any], warmup: int = args.warmup) -> tuple[float, float, float]:
        """Samples/s, the share of the wall time in next(stream), its thread CPU ms a step."""
        for _ in range(warmup):
            trainer.train_step(next(stream))
        if pin:
            torch.cuda.synchronize(device)
        waited = cpu = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            batch = next(stream)
            waited += time.perf_counter() - wall0
            cpu += time.thread_time() - cpu0
            trainer.train_step(batch)
        if pin:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        return args.steps * rows / wall, waited / wall, 1e3 * cpu / args.steps

    def fed(workers: int, packed: bool) -> Iterator[Any]:
        loader = make_dataloader(
            dataset, config=config, num_workers=workers, pin_memory=pin, dedup=True,
            packed=packed, epochs_ahead=args.epochs_ahead,
        )  # fmt: skip
        while True:  # epoch after epoch, as a training run reads
            empty = True
            for batch in loader:
                empty = False
                yield batch.to(device, non_blocking=pin)
            if empty:
                msg = f"{workers} workers read no full batch of {rows} rows from {dataset}"
                raise SystemExit(msg)

    ways = {"packed": ["fed"], "tensors": ["fed_tensors"], "both": ["fed", "fed_tensors"]}
    ways_run = ["model_only", *ways[args.fed_transport]]
    out: dict[str, Any] = {
        "end_to_end": [], "end_to_end_transport": args.fed_transport,
        "end_to_end_epochs_ahead": args.epochs_ahead,
    }  # fmt: skip
    for workers in args.workers:
        runs: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways_run}
        for r in range(args.rounds):
            for way in _rotated(ways_run, r):
                if way == "model_only":
                    runs[way].append(rate(iter(preloaded)))
                else:
                    # every worker delivers twice before the clock starts: a worker's start
                    # (imports, compiling the kernels, opening the files) is not reading speed
                    with contextlib.closing(fed(workers, way == "fed")) as stream:
                        runs[way].append(rate(stream, warmup=args.warmup + 2 * workers))
                got, share, cpu_ms = runs[way][-1]
                print(f"  workers {workers} round {r} {way:11s} {got:12,.0f} samples/s "
                      f"(in next() {share:.0%} of the time, {cpu_ms:.2f} ms CPU a step)",
                      file=sys.stderr)  # fmt: skip
        rates = {way: [got for got, _, _ in runs[way]] for way in ways_run}
        main = "fed" if "fed" in rates else "fed_tensors"
        ratio = ratio_spread(rates[main], rates["model_only"])
        point = {
            "workers": workers,
            "vs_model_only": ratio["median"],
            "vs_model_only_spread": ratio,
            "samples_per_s_fed": statistics.median(rates[main]),
            "samples_per_s_model_only": statistics.median(rates["model_only"]),
            "fed_next_share": statistics.median(share for _, share, _ in runs[main]),
            "fed_next_cpu_ms": statistics.median(cpu for _, _, cpu in runs[main]),
        }
        if args.fed_transport == "both":
            tensors = ratio_spread(rates["fed_tensors"], rates["model_only"])
            point["tensors_vs_model_only"] = tensors["median"]
            point["tensors_vs_model_only_spread"] = tensors
            point["samples_per_s_fed_tensors"] = statistics.median(rates["fed_tensors"])
            point["tensors_next_share"] = statistics.median(s for _, s, _ in runs["fed_tensors"])
        out["end_to_end"].append(point)
    best = max(out["end_to_end"], key=lambda point: point["vs_model_only"])
    reached = [p for p in out["end_to_end"] if p["vs_model_only"] >= 0.9]
    out["end_to_end_vs_model_only"] = best["vs_model_only"]
    out["end_to_end_vs_model_only_spread"] = best["vs_model_only_spread"]
    out["end_to_end_workers"] = best["workers"]
    out["end_to_end_workers_for_0_9"] = min(p["workers"] for p in reached) if reached else None
    return out


@contextlib.contextmanager
def saved_bytes_counter(model: Any, scope: list[Any]) -> Iterator[dict[str, int]]:
    """Count bytes of tensors saved for backward: in ``scope`` modules (plus their outputs)
    and in total. Parameters are excluded; each storage is counted once."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    counts = {"scope": 0, "total": 0, "scope_outputs": 0}
    depth = [0]

    def add(t: torch.Tensor, key: str) -> None:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen or ptr == 0:
            return
        seen.add(ptr)
        counts[key] += storage.nbytes()
        counts["total"] += storage.nbytes() if key != "total" else 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        add(t, "scope" if depth[0] else "total")
        return t

    def pre(_m: Any, _inp: Any) -> None:
        depth[0] += 1

    def post(_m: Any, _inp: Any, out: Any) -> None:
        depth[0] -= 1
        values = out.values() if isinstance(out, dict) else [out]
        for v in values:
            t = getattr(v, "values", v) if not isinstance(v, torch.Tensor) else v
            t = t() if callable(t) else t  # a jagged type's values() (JaggedEmbeddings: a field)
            if isinstance(t, torch.Tensor):
                add(t, "scope_outputs")

    handles = []
    for m in scope:
        if m is not None:
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counts
    finally:
        for h in handles:
            h.remove()


def measure_memory(
    schema: Any, on: list[Any], off: list[Any], *, model_config: Any, budget_mib: float
) -> dict[str, Any]:
    """Activation bytes of the embedding + attention modules and of the whole forward."""
    from trainer.models import DLRM
    from trainer.runlog import batch_dedup_factor

    model = DLRM.from_schema(schema, model_config)
    model.set_dedup_groups(())  # the plain batch through every row (the no-dedup compute)
    out: dict[str, Any] = {}
    for mode, batch in (("on", on[0]), ("off", off[0])):
        scope = [model.ebc, model.seq, model.attention]
        with saved_bytes_counter(model, scope) as counts:
            model(batch).sum()
        out[mode] = dict(counts)
    b = on[0].batch_size
    emb_on = out["on"]["scope"] + out["on"]["scope_outputs"]
    emb_off = out["off"]["scope"] + out["off"]["scope_outputs"]
    per_on, per_off = out["on"]["total"] / b, out["off"]["total"] / b
    budget = budget_mib * 2**20
    wanted = set(model.attention.features) if model.attention is not None else None
    history = next((g for g in on[0].ikjts.values() if wanted and wanted <= set(g.keys())), None)
    return {
        "activation_memory_ratio": emb_off / emb_on,
        "embedding_attention_bytes_on": emb_on,
        "embedding_attention_bytes_off": emb_off,
        "embedding_attention_saved_bytes_on": out["on"]["scope"],
        "embedding_attention_saved_bytes_off": out["off"]["scope"],
        "dedup_factor_sparse_values": batch_dedup_factor(on[0]),
        "dedup_factor_history_rows": (history.batch_size / history.num_unique) if history else None,
        "dedup_factor_history_values": history.dedup_factor if history else None,
        "forward_saved_bytes_per_sample_on": per_on,
        "forward_saved_bytes_per_sample_off": per_off,
        "memory_budget_mib": budget_mib,
        "max_batch_on": int(budget // per_on),
        "max_batch_off": int(budget // per_off),
        "max_batch_ratio": int(budget // per_on) / max(int(budget // per_off), 1),
        "max_batch_method": "budget / measured forward saved-tensor bytes per sample at batch_size",
    }


def measure_vs_torchrec(
    schema: Any, plain: list[Any], dedup: list[Any], *, dim: int, num_embeddings: int
) -> dict[str, Any]:
    """Our embedding bags vs TorchRec's EmbeddingBagCollection, same tables and weights: our
    plain PooledEmbeddings, and the swapped-in trainer.torchrec collection on plain KJTs and on
    the deduplicated batches of the same rows."""
    import torch

    from recpipe._deps import optional_import
    from recpipe.torchrec_interop import to_torchrec
    from trainer.modules import PooledEmbeddings, TableConfig
    from trainer.torchrec import EmbeddingBagCollection as Swapped

    trm = optional_import("torchrec.modules.embedding_modules", purpose="vs_torchrec_ebc")
    trc = optional_import("torchrec.modules.embedding_configs", purpose="vs_torchrec_ebc")
    names = list(schema.sparse_names)

    def modulo(v: torch.Tensor) -> torch.Tensor:
        return torch.remainder(v, num_embeddings)

    kjts = [b.kjt.map_values(modulo) for b in plain]
    tr_kjts = [to_torchrec(k) for k in kjts]
    groups = [
        dataclasses.replace(
            b,
            kjt=b.kjt.map_values(modulo),
            ikjts={n: g.map_values(modulo) for n, g in b.ikjts.items()},
        )
        for b in dedup
    ]

    def ours(sparse: bool) -> Any:
        tables = [TableConfig(f, num_embeddings, dim, (f,), sparse_grad=sparse) for f in names]
        return PooledEmbeddings(tables, seed=0)

    ebc_dense, ebc_sparse = ours(False), ours(True)
    theirs = trm.EmbeddingBagCollection(
        tables=[
            trc.EmbeddingBagConfig(
                name=f, embedding_dim=dim, num_embeddings=num_embeddings, feature_names=[f],
                pooling=trc.PoolingType.SUM,
            )
            for f in names
        ],
        device=torch.device("cpu"),
    )  # fmt: skip
    with torch.no_grad():
        for f in names:
            theirs.embedding_bags[f].weight.copy_(ebc_dense.tables[f].weight)
    swapped = Swapped(theirs.embedding_bag_configs())
    swapped.load_state_dict(theirs.state_dict())
    # same numbers first
    with torch.no_grad():
        ref = theirs(tr_kjts[0]).to_dict()
        got = ebc_dense(kjts[0])
        got_swapped = swapped(groups[0]).to_dict()
    max_diff = max(float((ref[f] - got[f]).abs().max()) for f in names)
    swap_diff = max(float((ref[f] - got_swapped[f]).abs().max()) for f in names)

    def step_ours(m: Any, k: Any, backward: bool) -> None:
        out = m(k)
        if backward:
            m.zero_grad(set_to_none=True)
            torch.stack(list(out.values())).sum().backward()

    def step_theirs(k: Any, backward: bool, module: Any = theirs) -> None:
        out = module(k)
        if backward:
            module.zero_grad(set_to_none=True)
            out.values().sum().backward()

    cpu = torch.device("cpu")

    def cases(k: Any, tk: Any, g: Any) -> dict[str, Callable[[], Any]]:
        def forward_only(fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                with torch.no_grad():
                    return fn()

            return run

        return {
            "ours_fb": lambda: step_ours(ebc_dense, k, True),
            "torchrec_fb": lambda: step_theirs(tk, True),
            "ours_f": forward_only(lambda: step_ours(ebc_dense, k, False)),
            "torchrec_f": forward_only(lambda: step_theirs(tk, False)),
            "ours_sparse_fb": lambda: step_ours(ebc_sparse, k, True),
            "swap_plain_fb": lambda: step_theirs(tk, True, swapped),
            "swap_dedup_fb": lambda: step_theirs(g, True, swapped),
        }

    names = list(cases(kjts[0], tr_kjts[0], groups[0]))
    times: dict[str, list[Timing]] = {}
    for _ in range(2):  # the second pass is timed: the first warms every case up alike
        times = {name: [] for name in names}
        for r, (k, tk, g) in enumerate(zip(kjts, tr_kjts, groups)):
            fns = cases(k, tk, g)
            for name in _rotated(names, r):
                times[name].append(_timed(fns[name], cpu))
    b = plain[0].batch_size
    sps = {k: b / statistics.median(t.cpu_s for t in v) for k, v in times.items()}
    ratios = {
        "vs_torchrec_ebc": _ratio(times, "ours_fb", "torchrec_fb", cpu),
        "vs_torchrec_ebc_forward": _ratio(times, "ours_f", "torchrec_f", cpu),
        "vs_torchrec_ebc_ours_sparse_grad": _ratio(times, "ours_sparse_fb", "torchrec_fb", cpu),
        "torchrec_swap_plain": _ratio(times, "swap_plain_fb", "torchrec_fb", cpu),
        "torchrec_swap_dedup_speedup": _ratio(times, "swap_dedup_fb", "torchrec_fb", cpu),
    }
    return {
        **{name: _headline(r) for name, r in ratios.items()},
        **{f"{name}_spread": r for name, r in ratios.items()},
        "ebc_samples_per_s": sps,
        "ebc_max_abs_diff_vs_torchrec": max_diff,
        "torchrec_swap_dedup_max_abs_diff": swap_diff,
        "ebc_tables": len(names),
    }


# -- driver -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from readers.dataset import dataset_schema
    from trainer.models import ModelConfig

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        synth = None
        if args.data is not None:
            dataset = args.data
        else:
            dataset, synth = build_dataset(work, requests=args.requests, seed=args.seed)
        schema = dataset_schema(dataset)
        count = args.warmup + args.steps
        on = load_batches(dataset, batch_size=args.batch_size, count=count, dedup=True)
        off = load_batches(dataset, batch_size=args.batch_size, count=count, dedup=False)
        if len(on) < count:
            msg = f"the dataset yields {len(on)} full batches of {args.batch_size}, need {count}"
            raise SystemExit(msg)
        model_config = ModelConfig(
            embedding_dim=args.embedding_dim, num_embeddings=args.num_embeddings, seed=args.seed,
            sparse_grad=not args.dense_grads,
        )  # fmt: skip
        if args.threads_only:
            print("default --threads vs 1 thread, training steps (alternated):", file=sys.stderr)
            return measure_threads(
                schema, on, model_config=model_config, steps=args.threads_steps,
                warmup=args.warmup, device=device,
            )  # fmt: skip
        if args.exact_only:
            print("exact vs fast dense gradients, training steps (alternated):", file=sys.stderr)
            return measure_exact_dense(
                schema, on, model_config=model_config, steps=args.threads_steps,
                warmup=args.warmup, device=device,
            )  # fmt: skip
        print("dedup on/off training steps (alternated):", file=sys.stderr)
        results: dict[str, Any] = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "requests": args.requests if args.data is None else None,
            "model": {
                "embedding_dim": args.embedding_dim,
                "num_embeddings": args.num_embeddings,
                "sparse_grad": not args.dense_grads,
                "attention": "user_liked_items + user_liked_sellers (1 encoder layer, 2 heads)",
            },
        }
        results.update(
            measure_speedup(
                schema, on, off, model_config=model_config, warmup=args.warmup, device=device
            )
        )
        print("dedup on vs --dedup off, per-step losses (sgd, adagrad, adam):", file=sys.stderr)
        results.update(
            measure_bitwise(
                schema, on, off, model_config=model_config, steps=args.bitwise_steps,
                device=device,
            )
        )  # fmt: skip
        results.update(
            measure_memory(
                schema, on, off, model_config=model_config, budget_mib=args.memory_budget_mib
            )
        )
        print("partial IKJT vs expanded training steps (alternated):", file=sys.stderr)
        results.update(
            measure_partial(
                schema, on, model_config=model_config, warmup=args.warmup, device=device
            )
        )
        if args.end_to_end:
            print("training fed by the readers vs preloaded batches:", file=sys.stderr)
            fed_data = args.end_to_end_data or dataset
            results["end_to_end_data"] = str(fed_data)
            results.update(
                measure_end_to_end(
                    fed_data, dataset_schema(fed_data), model_config=model_config, args=args,
                    device=device,
                )
            )  # fmt: skip
        if device.type == "cpu":
            results.update(
                measure_vs_torchrec(
                    schema, off[: args.ebc_batches], on[: args.ebc_batches], dim=args.embedding_dim,
                    num_embeddings=args.num_embeddings,
                )
            )  # fmt: skip
        print("default --threads vs 1 thread, training steps (alternated):", file=sys.stderr)
        results.update(
            measure_threads(
                schema, on, model_config=model_config, steps=args.threads_steps,
                warmup=args.warmup, device=device,
            )
        )  # fmt: skip
        torch.set_num_threads(args.threads)
        print("exact vs fast dense gradients, training steps (alternated):", file=sys.stderr)
        results.update(
            measure_exact_dense(
                schema, on, model_config=model_config, steps=args.threads_steps,
                warmup=args.warmup, device=device,
            )
        )  # fmt: skip
        if synth is not None:
            results["hidden_model_auc"] = synth.get("hidden_model_auc")
    return results


def _table(results: dict[str, Any]) -> str:
    rows = [
        ("dedup_speedup", "samples/s dedup on / off (target >= 2.5)", results["dedup_speedup"]),
        ("activation_memory_ratio", "emb + attention activations off / on", results["activation_memory_ratio"]),
        ("  dedup factor (values)", "sparse values expanded / stored", results["dedup_factor_sparse_values"]),
        ("  dedup factor (history rows)", "B / U of the attention group", results["dedup_factor_history_rows"]),
        ("max_batch_ratio", f"largest batch in {results['memory_budget_mib']:.0f} MiB, on / off", results["max_batch_ratio"]),
        ("vs_torchrec_ebc", "our plain EBC / TorchRec EBC (fwd+bwd)", results.get("vs_torchrec_ebc")),
        ("  forward only", "", results.get("vs_torchrec_ebc_forward")),
        ("  ours with sparse grads", "", results.get("vs_torchrec_ebc_ours_sparse_grad")),
        ("torchrec_swap_dedup_speedup", "swapped-in ours on IKJTs / TorchRec EBC", results.get("torchrec_swap_dedup_speedup")),
        ("  swapped-in on plain KJTs", "", results.get("torchrec_swap_plain")),
        ("partial_speedup", "samples/s partial IKJT / expanded", results.get("partial_speedup")),
        ("default_threads_vs_one", "samples/s default --threads / 1 (>= 0.95)", results.get("default_threads_vs_one")),
        ("exact_dense_vs_fast", "samples/s exact dense / --fast-dense", results.get("exact_dense_vs_fast")),
        ("  partial dedup factor", "ids expanded / stored, partial feature", results.get("partial_dedup_factor")),
        ("  embedding step alone", "its pooled embedding fwd+bwd", results.get("partial_embedding_speedup")),
    ]  # fmt: skip
    lines = [f"{'figure':<30} {'what':<45} {'value':>8}"]
    for name, what, value in rows:
        text = "-" if value is None else f"{value:8.2f}"
        lines.append(f"{name:<30} {what:<45} {text:>8}")
    for point in results.get("end_to_end", []):
        lines.append(
            f"{'end_to_end_vs_model_only':<30} {'fed by ' + str(point['workers']) + ' workers / preloaded':<45} "
            f"{point['vs_model_only']:8.2f}"
        )
    lines.append(
        f"samples/s on {results['samples_per_s_on']:,.0f}, off {results['samples_per_s_off']:,.0f} "
        f"(B={results['batch_size']}, {results['timed_steps']} timed steps, {results['threads']} "
        f"thread(s), {results['device']}); max loss rel. diff on vs off "
        f"{results['max_loss_rel_diff_on_vs_off']:.2e} (no-dedup compute); --dedup off "
        f"losses equal bit for bit: {results['losses_equal_bitwise']} "
        f"({results['losses_equal_bitwise_by_optimizer']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault(
        "NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba_cache")
    )
    results = run(args)
    if args.threads_only:
        spread = results["default_threads_vs_one_spread"]["wall"]
        print(json.dumps(results, indent=2, default=float))
        print(f"default_threads_vs_one {results['default_threads_vs_one']:.3f} "
              f"(spread {spread}; {results['default_threads']} default threads)")  # fmt: skip
        return 0  # a partial run: no results file
    if args.exact_only:  # one figure: updated in the results file, the others kept
        spread = results["exact_dense_vs_fast_spread"]["cpu"]
        print(f"exact_dense_vs_fast {results['exact_dense_vs_fast']:.3f} (spread {spread})")
        kept = json.loads(args.out.read_text()) if args.out.exists() else {}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**kept, **results}, indent=2, default=float) + "\n")
        print(f"updated {args.out}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(_table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
