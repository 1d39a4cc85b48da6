"""ESD's sample dispatch, simulated: the synthetic dataset's global batches replayed through each
dispatch policy with per-rank caches and bandwidths, without training.

The paper's setting by default: 8 ranks, 4 of them at 10x the bandwidth of the other 4, 128
samples per rank (global batches of 1024), each rank's cache 8% of the rows the replay reads,
session pieces of at most 32 rows. Every policy replays the same cut batches from empty caches
(`readers.dispatch`); the cache shadow says what each step moves. A row transfer moves the
embedding and its row-wise Adagrad state (4 * (dim + 1) bytes) over the rank's link.

Figures (written to benchmarks/results/dispatch.json):
  cost_s                 per policy: seconds of links busy over the replay, per kind: miss
                         pulls and update pushes (the cost model's terms; their sum is `cost`),
                         evict pushes, and gradients of rows several ranks read in one step
                         (`shared`, sent home by each reader); `all` sums every kind
  cost                   cost_s[policy]["cost"] of the headline order (the first of --orders)
  cost_vs_laia_alpha1    cost(esd, alpha = 1) / cost(laia). Target <= 0.70 (ESD: -36.8%)
  cost_vs_laia_alpha0    cost(esd, alpha = 0) / cost(laia) (ESD: -7%)
  cost_order_holds       cost(alpha=1) <= cost(0.5) <= cost(0) <= laia <= random
  step_transfer_s        per policy: the slowest rank's link time per step (transfers of one
                         rank run in parallel with the other ranks'), mean over steps
  dispatch_ms            per policy: the policy and the shadow replay per global batch (spread
                         over alternated repeats; CPU time beside it); `prepare_ms`: cutting a
                         batch into pieces and listing their rows, once per batch
  dispatch_ms_alpha1     dispatch_ms of esd (alpha = 1) in the headline order, wall (its
                         spread: dispatch_ms_alpha1_spread) and CPU (dispatch_cpu_ms_alpha1)
  dispatch_vs_saved      what a rank pays per step to dispatch (preparing the global batch:
                         pieces and their rows; esd's placement at alpha = 1 and the shadow
                         replay) / the step transfer time esd saves against the contiguous cut
                         (no dispatch), at the replay's link rates. Target < 1
  dispatch_vs_saved_10gbit  the same with every link at 10 Gbit/s (esd and contiguous replayed
                         again at that rate)
  dispatch_vs_saved_cluster_rates  the same at the cluster harness's ESD rates (fast ranks at
                         100 Mbit/s, the others at 10; esd and contiguous replayed again)
  vs_contiguous          both, with the step transfer times and the seconds saved; `vs_random`:
                         the dispatch time against what esd saves over random dispatch
  reading                per-rank samples/s of a rank reader (readers.ranks.RankBatchDataset, rank
                         0 of --ranks at --micro-batch) with the contiguous cut and with
                         --dispatch esd and random (every rank reads and prices the whole global
                         batch), spread over alternated repeats; --baseline-tree TREE measures a
                         second source tree (e.g. the commit before a change) in the same run
  training               a real --train-ranks run of `recpipe train --dispatch esd` and
                         `--dispatch random` (in-process readers, gloo), every rank with a real
                         embedding cache (`--cache-rows`: the replay's cache size; the same
                         share of fast ranks as the replay's, the first ones): samples/s of each (spread over alternated
                         runs), esd_vs_random, and the link seconds of the pulls and pushes the
                         caches made (cache_link_s; train_cache_cost_esd_vs_random)
  piece_rows_sweep       cost of esd (alpha = 1), laia and random at other piece sizes
                         (1 = single samples)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import alternate, spread, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dispatch.json"
KINDS = ("pulls", "pushes", "evict_pushes", "shared")
TEN_GBIT = 10e9 / 8  # bytes/s
# the cluster harness's ESD links (`benchmarks/cluster.py --only esd`): 100 and 10 Mbit/s
CLUSTER_FAST, CLUSTER_SLOW = 100e6 / 8, 10e6 / 8  # bytes/s

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dispatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200_000, help="synthetic requests")
    parser.add_argument("--ranks", type=int, default=8, help="ranks W")
    parser.add_argument("--fast-ranks", type=int, default=4, help="ranks with the fast link")
    parser.add_argument("--fast-factor", type=float, default=10.0, help="fast / slow bandwidth")
    parser.add_argument("--bandwidth", type=float, default=12.5e6, help="slow link, bytes/s")
    parser.add_argument("--micro-batch", type=int, default=128, help="samples per rank m")
    parser.add_argument("--cache-share", type=float, default=0.08, help="cache / cold rows read")
    parser.add_argument(
        "--hot-share", type=float, default=0.5,
        help="rows read in at least this share of the steps are the hot set (1: none)",
    )  # fmt: skip
    parser.add_argument(
        "--orders", type=str, default="time,session",
        help="dataset row orders to replay: time (rows by ts), session (clustered, RecD)",
    )  # fmt: skip
    parser.add_argument("--shuffle", action="store_true", help="shuffle the reader (seeded)")
    parser.add_argument("--piece-rows", type=int, default=32, help="rows per session piece at most")
    parser.add_argument(
        "--sweep-piece-rows", type=str, default="1,8", help="other piece sizes (comma-separated)"
    )
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--batches", type=int, default=0, help="global batches (0: all)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repeats per policy")
    parser.add_argument(
        "--train-steps", type=int, default=200,
        help="steps of the real 2-rank `recpipe train` runs, esd vs random (0: none)",
    )  # fmt: skip
    parser.add_argument("--train-ranks", type=int, default=2, help="ranks of those runs")
    parser.add_argument(
        "--read-steps", type=int, default=100,
        help="steps of rank 0's reader per reading run, contiguous vs esd vs random (0: none)",
    )  # fmt: skip
    parser.add_argument("--read-repeats", type=int, default=3, help="alternated reading runs")
    parser.add_argument(
        "--baseline-tree", type=Path,
        help="a second source tree whose reader is timed in the same runs (e.g. the commit "
        "before a change, from `git worktree add`)",
    )  # fmt: skip
    parser.add_argument("--train-repeats", type=int, default=3, help="alternated runs per policy")
    parser.add_argument("--data", type=Path, help="an existing clustered dataset (skip synth)")
    parser.add_argument("--work", type=Path, help="working directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    return parser.parse_args(argv)


def build_datasets(work: Path, *, requests: int, seed: int, orders: list[str]) -> dict[str, Path]:
    """Synthetic logs -> one dataset per row order (``session``: clustered; ``time``: by ts)."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed), progress=True)
    out = {}
    for order in orders:
        out[order] = work / order
        build(logs.features, out[order], events=logs.events, schema=default_schema(),
              config=BuildConfig(order=order), overwrite=True, progress=True)  # fmt: skip
    return out


def read_batches(dataset: Path, *, rows: int, limit: int, shuffle: bool, seed: int) -> list[Any]:
    """The first ``limit`` (0: all) full global batches of one epoch."""
    from readers.dataset import iter_batches
    from readers.source import ReaderConfig

    config = ReaderConfig(batch_size=rows, shuffle=shuffle, seed=seed, last_batch="drop")
    out = []
    for batch in iter_batches(dataset, config=config, dedup=True):
        out.append(batch)
        if limit and len(out) == limit:
            break
    return out


class Replay:
    """The prepared batches of one piece size, and replays of them through a policy."""

    def __init__(self, batches: list[Any], *, args: argparse.Namespace, piece_rows: int) -> None:
        from readers.dispatch import DispatchConfig, Dispatcher, TableMap

        self.args = args
        self.tables = TableMap.per_feature(batches[0].sparse_keys)
        self.world = args.ranks
        bandwidth = [args.bandwidth * args.fast_factor] * args.fast_ranks
        bandwidth += [args.bandwidth] * (args.ranks - args.fast_ranks)
        self.base = DispatchConfig(
            max_piece_rows=piece_rows, bandwidths=tuple(bandwidth), row_bytes=4 * (args.dim + 1)
        )
        preparer = Dispatcher(self.base, world_size=self.world, micro_batch=args.micro_batch,
                            tables=self.tables)  # fmt: skip
        self.index = preparer.index
        self.prepare_s = []
        self.prepared = []
        for batch in batches:
            start = time.perf_counter()
            self.prepared.append(preparer.prepare(batch))
            self.prepare_s.append(time.perf_counter() - start)
        self.seconds_per_row = preparer.seconds_per_row
        # the hot set: rows read in at least `hot_share` of the steps (counted over the replay)
        steps = np.zeros(self.index.num_rows, dtype=np.int64)
        for prepared in self.prepared:
            steps[np.unique(prepared.rows.row)] += 1
        hot = np.flatnonzero(steps >= args.hot_share * len(self.prepared))
        self.hot_keys = self.index.keys(hot)
        self.hot_rows = int(hot.size)
        self.hot_access_share = float(steps[hot].sum() / max(steps.sum(), 1))
        self.cold_rows = self.index.num_rows - self.hot_rows
        self.cache_rows = max(1, round(args.cache_share * self.cold_rows))

    def config(self, policy: str, alpha: float, regret: str = "mean") -> Any:
        from dataclasses import replace

        return replace(self.base, policy=policy, alpha=alpha, cache_rows=(self.cache_rows,),
                       seed=self.args.seed, regret=regret)  # fmt: skip

    def run(
        self, policy: str, alpha: float = 1.0, regret: str = "mean", *,
        bandwidth: float | tuple[float, ...] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Replay every batch from empty caches: link seconds per kind, step times, hits.

        ``policy="contiguous"`` replays the undispatched cut (rank r trains on rows
        ``[r*m, (r+1)*m)``); ``bandwidth`` puts every rank on a link of that many bytes/s (a
        tuple: rank by rank).
        """
        from dataclasses import replace

        from readers.dispatch import Dispatcher

        config = self.config("esd" if policy == "contiguous" else policy, alpha, regret)
        if bandwidth is not None:
            rates = bandwidth if isinstance(bandwidth, tuple) else (bandwidth,)
            config = replace(config, bandwidths=rates)
        d = Dispatcher(config, world_size=self.world, micro_batch=self.args.micro_batch,
                       tables=self.tables, index=self.index)  # fmt: skip
        d.set_hot(*self.hot_keys)
        per_kind = dict.fromkeys(KINDS, 0.0)
        step_all, model = [], 0.0
        reads = pulls = split = 0
        for prepared in self.prepared:
            out = _contiguous(d, prepared) if policy == "contiguous" else d.dispatch(prepared)
            split += out.split_pieces
            sec = out.transfers.seconds(d.seconds_per_row)
            for kind in KINDS:
                per_kind[kind] += float(sec[kind].sum())
            step_all.append(float(sum(sec[k] for k in KINDS).max()))
            model += out.model_cost
            counts = out.transfers.counts()
            reads += int(counts["reads"].sum())
            pulls += int(counts["pulls"].sum())
        return {
            "cost": per_kind["pulls"] + per_kind["pushes"],
            "all": sum(per_kind.values()),
            **per_kind,
            "model_cost": model,
            "step_transfer_s": float(np.mean(step_all)),
            "hit_rate": 1.0 - pulls / max(reads, 1),
            "split_pieces_per_step": split / len(self.prepared),
        }


def _contiguous(d: Any, prepared: Any) -> Any:
    """The contiguous cut of one prepared batch replayed on ``d``'s shadow (nothing decided:
    rank r reads the rows of its own part)."""
    from readers.dispatch import Dispatch

    m, w = d.micro_batch, d.world_size
    row_rank = np.arange(m * w, dtype=np.int64) // m
    flow = np.zeros((prepared.pieces.num_pieces, w), dtype=np.int64)
    np.add.at(flow, (prepared.pieces.piece_of_row, row_rank), 1)
    transfers = d.shadow.step(d.reads(prepared, flow, row_rank))
    rows = tuple(np.arange(j * m, (j + 1) * m, dtype=np.int64) for j in range(w))
    return Dispatch(step=d.shadow.steps - 1, rows=rows, flow=flow, model_cost=0.0,
                    transfers=transfers)  # fmt: skip


CASES = {
    "esd_alpha1": ("esd", 1.0),
    "esd_alpha0.5": ("esd", 0.5),
    "esd_alpha0": ("esd", 0.0),
    # ESD's own regret (second-smallest minus smallest cost): reported beside the default
    "esd_alpha0_second_regret": ("esd", 0.0, "second"),  # not in the order
    "laia": ("laia", 1.0),
    "round_robin": ("round-robin", 1.0),
    "random": ("random", 1.0),
    "contiguous": ("contiguous", 1.0),  # not dispatched: what dispatching saves is against it
}
ORDER = ["esd_alpha1", "esd_alpha0.5", "esd_alpha0", "laia", "random"]


def replay_order(dataset: Path, args: argparse.Namespace, *, label: str) -> dict[str, Any]:
    """Every policy over one dataset's global batches: costs, ratios, dispatch times."""
    from tqdm import tqdm

    rows = args.ranks * args.micro_batch
    batches = read_batches(dataset, rows=rows, limit=args.batches, shuffle=args.shuffle,
                           seed=args.seed)  # fmt: skip
    if not batches:
        sys.exit(f"no global batch of {rows} rows in {dataset}: use more --requests")
    replay = Replay(batches, args=args, piece_rows=args.piece_rows)
    results: dict[str, dict[str, Any]] = {}

    def case(name: str) -> Any:
        def call() -> None:
            results[name] = replay.run(*CASES[name])

        return call

    with tqdm(total=len(CASES) * args.repeats, desc=f"{label}: policies", file=sys.stderr) as bar:
        runs = alternate({n: case(n) for n in CASES}, repeats=args.repeats, progress=bar.update)
    steps = len(batches)
    cost = {name: r["cost"] for name, r in results.items()}
    holds = all(cost[a] <= cost[b] * (1 + 1e-12) for a, b in itertools.pairwise(ORDER))
    dispatch_ms = {
        name: {
            "wall": spread([t.wall_s * 1e3 / steps for t in timings]),
            "cpu": spread([t.cpu_s * 1e3 / steps for t in timings]),
        }
        for name, timings in runs.items()
    }
    saved = results["random"]["step_transfer_s"] - results["esd_alpha1"]["step_transfer_s"]
    esd_ms = dispatch_ms["esd_alpha1"]["wall"]["median"]
    # what a rank pays per step to dispatch (prepare + place + replay the shadow) against the
    # step transfer time esd (alpha = 1) saves over the contiguous cut: at the replay's links and
    # with every link at 10 Gbit/s (esd and contiguous replayed again at that rate)
    per_step_s = (esd_ms + statistics.median(replay.prepare_s) * 1e3) / 1e3
    fast = {name: replay.run(*CASES[name], bandwidth=TEN_GBIT)
            for name in ("esd_alpha1", "contiguous")}  # fmt: skip
    # the cluster harness's rates: the replay's fast ranks at 100 Mbit/s, the others at 10
    harness = (CLUSTER_FAST,) * args.fast_ranks + (CLUSTER_SLOW,) * (args.ranks - args.fast_ranks)
    cluster = {name: replay.run(*CASES[name], bandwidth=harness)
               for name in ("esd_alpha1", "contiguous")}  # fmt: skip
    vs_contiguous = {}
    for rate, runs_at in (("model", results), ("10gbit", fast), ("cluster", cluster)):
        gain = runs_at["contiguous"]["step_transfer_s"] - runs_at["esd_alpha1"]["step_transfer_s"]
        vs_contiguous[rate] = {
            "saved_step_transfer_s": gain,
            "dispatch_s_per_step": per_step_s,
            # dispatched once per global batch (one rank, for all): a rank's share of it
            "dispatch_vs_saved": per_step_s / replay.world / gain if gain > 0 else float("inf"),
            # every rank dispatching the whole global batch itself (the per-rank cut)
            "per_rank_cut_vs_saved": per_step_s / gain if gain > 0 else float("inf"),
            "step_transfer_s": {
                n: r["step_transfer_s"]
                for n, r in runs_at.items()
                if n in ("esd_alpha1", "contiguous")
            },
        }
    sweep = {}
    for size in [int(s) for s in args.sweep_piece_rows.split(",") if s.strip()]:
        if size == args.piece_rows:
            continue
        other = Replay(batches, args=args, piece_rows=size)
        sweep[str(size)] = {
            p: other.run(*CASES[p])["cost"] for p in ("esd_alpha1", "laia", "random")
        }
    return {
        "dataset": {
            "global_batches": steps,
            "rows_read": replay.index.num_rows,
            "hot_rows": replay.hot_rows,
            "hot_access_share": replay.hot_access_share,
            "cache_rows": replay.cache_rows,
            "pieces_per_batch": float(np.mean([p.pieces.num_pieces for p in replay.prepared])),
            "pairs_per_batch": float(np.mean([p.rows.row.size for p in replay.prepared])),
        },
        "cost_s": results,
        "cost_vs_laia_alpha1": cost["esd_alpha1"] / cost["laia"],
        "cost_vs_laia_alpha0": cost["esd_alpha0"] / cost["laia"],
        "cost_vs_laia_alpha0_second_regret": cost["esd_alpha0_second_regret"] / cost["laia"],
        "cost_vs_random_alpha1": cost["esd_alpha1"] / cost["random"],
        "all_vs_laia_alpha1": results["esd_alpha1"]["all"] / results["laia"]["all"],
        "cost_order_holds": holds,
        "step_transfer_s": {name: r["step_transfer_s"] for name, r in results.items()},
        "dispatch_ms": dispatch_ms,
        "prepare_ms": spread([s * 1e3 for s in replay.prepare_s]),
        "saved_step_transfer_s": saved,
        "dispatch_vs_saved": vs_contiguous["model"]["dispatch_vs_saved"],
        "dispatch_vs_saved_10gbit": vs_contiguous["10gbit"]["dispatch_vs_saved"],
        "per_rank_cut_vs_saved": vs_contiguous["model"]["per_rank_cut_vs_saved"],
        "per_rank_cut_vs_saved_10gbit": vs_contiguous["10gbit"]["per_rank_cut_vs_saved"],
        "dispatch_vs_saved_cluster_rates": vs_contiguous["cluster"]["dispatch_vs_saved"],
        "per_rank_cut_vs_saved_cluster_rates": vs_contiguous["cluster"]["per_rank_cut_vs_saved"],
        "vs_contiguous": vs_contiguous,
        # the same per-step dispatch time against what esd saves over random (as reported
        # before the contiguous baseline): placement only, its CPU time, and with preparing
        "vs_random": {
            "dispatch_vs_saved": esd_ms / 1e3 / saved if saved > 0 else float("inf"),
            "dispatch_cpu_vs_saved": (
                dispatch_ms["esd_alpha1"]["cpu"]["median"] / 1e3 / saved
                if saved > 0
                else float("inf")
            ),
            "dispatch_prepare_vs_saved": per_step_s / saved if saved > 0 else float("inf"),
        },
        "piece_rows_sweep": sweep,
    }


def train_rates(
    dataset: Path, args: argparse.Namespace, work: Path, *, cache_rows: int
) -> dict[str, Any]:
    """Real multi-rank ``recpipe train`` runs (gloo, in-process readers) with ``--dispatch esd``
    and ``--dispatch random``, alternated, every rank with a real embedding cache of
    ``cache_rows`` rows: samples/s, and the link seconds of the pulls and pushes the caches
    made (each rank's rows over its bandwidth, as the simulator counts them)."""
    import json
    import os
    import subprocess

    ranks = args.train_ranks
    fast = max(min(round(ranks * args.fast_ranks / args.ranks), ranks), 0)  # the same share
    bandwidths = [args.bandwidth * args.fast_factor] * fast + [args.bandwidth] * (ranks - fast)
    row_bytes = 4 * (args.dim + 1)
    here = Path(__file__).resolve().parents[1]
    trees = {"": here}  # a case "esd" runs this tree, "esd_baseline" --baseline-tree
    if args.baseline_tree is not None:
        trees["_baseline"] = args.baseline_tree.resolve()
    cases = [p + t for t in trees for p in ("esd", "random")]
    rates: dict[str, list[float]] = {c: [] for c in cases}
    costs: dict[str, list[dict[str, float]]] = {c: [] for c in cases}

    def case(name: str) -> Any:
        policy, _, tree = name.partition("_")
        tree = f"_{tree}" if tree else ""

        def call() -> None:
            out = work / f"train-{name}-{len(rates[name])}.json"
            argv = [
                sys.executable, "-m", "recpipe_cli", "train", str(dataset), "--quiet",
                "--nproc", str(ranks), "--batch-size", str(args.micro_batch),
                "--steps", str(args.train_steps), "--eval-fraction", "0",
                "--dispatch", policy, "--alpha", "1", "--cache-rows", str(cache_rows),
                "--bandwidths", ",".join(f"{b:g}" for b in bandwidths),
                "--embedding-dim", str(args.dim), "--seed", str(args.seed), "--json", str(out),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(trees[tree])}
            done = subprocess.run(argv, capture_output=True, text=True, env=env,
                                  cwd=trees[tree], timeout=3600)  # fmt: skip
            if done.returncode != 0:
                sys.exit(f"recpipe train --dispatch {policy} failed:\n{done.stderr[-4000:]}")
            doc = json.loads(out.read_text())
            rates[name].append(float(doc["samples_per_s"]))
            per_rank = doc["distributed"]["cache_per_rank"]
            link = {
                kind: sum(
                    r[kind] * row_bytes / b for r, b in zip(per_rank, bandwidths, strict=True)
                )
                for kind in ("pulls", "pushes", "evict_pushes")
            }
            reads = sum(r["reads"] for r in per_rank)
            costs[name].append({
                **link, "cost": link["pulls"] + link["pushes"],
                "hit_rate": 1.0 - sum(r["pulls"] for r in per_rank) / max(reads, 1),
                "train_loss": doc["train_loss"], "final_step_loss": doc["final_step_loss"],
            })  # fmt: skip

        return call

    alternate({c: case(c) for c in cases}, repeats=args.train_repeats, warmup=False)
    # the caches' transfers depend on the placements only: the same in every repeat
    cost = {p: costs[p][0] for p in costs}
    baseline = {}
    if len(trees) > 1:  # this tree against --baseline-tree, same runs
        baseline = {
            "baseline_tree": str(trees["_baseline"]),
            "samples_per_s_vs_baseline": {
                p: statistics.median(rates[p]) / statistics.median(rates[f"{p}_baseline"])
                for p in ("esd", "random")
            },
            "same_transfers_and_losses_as_baseline": {
                p: cost[p] == cost[f"{p}_baseline"] for p in ("esd", "random")
            },
        }
    return {
        **baseline,
        "ranks": ranks,
        "steps": args.train_steps,
        "cache_rows": cache_rows,
        "bandwidths": bandwidths,
        "samples_per_s": {p: spread(v) for p, v in rates.items()},
        "esd_vs_random": statistics.median(rates["esd"]) / statistics.median(rates["random"]),
        "esd_vs_random_repeats": [
            a / b for a, b in zip(rates["esd"], rates["random"], strict=True)
        ],
        "cache_link_s": cost,
        "cache_cost_esd_vs_random": cost["esd"]["cost"] / cost["random"]["cost"],
        "cache_costs_repeat": all(c == costs[p][0] for p in costs for c in costs[p]),
    }


# one rank reader's samples/s, run in a source tree of its own (the same code in every tree):
# argv = dataset, policy, ranks, micro-batch, steps, repeats, cache rows, bandwidths
_READ_RATE = """
import json, sys, time
import numpy as np
from readers.dataset import dataset_schema
from readers.dispatch.cut import rank_cut
from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
root, policy = sys.argv[1], sys.argv[2]
ranks, batch, steps, repeats, cache = (int(v) for v in sys.argv[3:8])
bandwidths = tuple(float(b) for b in sys.argv[8].split(","))
schema = dataset_schema(root)
policy, _, role = policy.partition("@")  # esd@source / esd@other: dispatched once
def cut_for():
    options = {} if policy == "contiguous" else {"cache_rows": (cache,), "bandwidths": bandwidths}
    return rank_cut(policy, schema=schema, alpha=1.0, **options)
def reader(cut, rank):
    return RankBatchDataset(root, schema=schema, config=ReaderConfig(batch_size=batch),
                            rank=rank, world_size=ranks, cut=cut)
recorded = []
if role:
    from readers.dispatch.cut import DispatchOnceCut
    def record(payload):
        recorded.append(payload.copy())
        return payload
    # the placements rank 0 would broadcast (not timed): rank 1 receives them in order
    if role == "other":
        for _, _ in zip(range(steps), reader(DispatchOnceCut(cut_for(), rank=0, world_size=ranks, share=record), 0)):
            pass
def once(count):
    if role == "source":  # rank 0: dispatches every global batch (its thread) for all ranks
        cut, rank = DispatchOnceCut(cut_for(), rank=0, world_size=ranks, share=lambda p: p), 0
    elif role == "other":  # rank 1: receives the placement, takes and converts its rows
        feed = iter(recorded)
        cut, rank = DispatchOnceCut(cut_for(), rank=1, world_size=ranks, share=lambda p: next(feed)), 1
    else:
        cut, rank = cut_for(), 0
    ds = reader(cut, rank)
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    for _ in ds:
        n += 1
        if n == count:
            break
    out = n * batch / (time.perf_counter() - wall), (time.process_time() - cpu) / n
    if role:
        cut.close()
    return out
once(min(steps, 3))  # compiles the kernels, warms the page cache
print(json.dumps([once(steps) for _ in range(repeats)]))
"""


def read_rates(dataset: Path, args: argparse.Namespace, *, cache_rows: int) -> dict[str, Any]:
    """Per-rank samples/s of rank 0's reader (``--ranks`` ranks of ``--micro-batch`` rows, the
    replay's links and cache size) with the contiguous cut and with ``esd`` and ``random``
    dispatch; the trees (this one, and ``--baseline-tree``) and policies alternated, each run in
    its own process."""
    import json
    import os
    import subprocess

    here = Path(__file__).resolve().parents[1]
    trees = {"current": here}
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree.resolve()
    bandwidth = [args.bandwidth * args.fast_factor] * args.fast_ranks
    bandwidth += [args.bandwidth] * (args.ranks - args.fast_ranks)
    plain = ("contiguous", "esd", "random")
    once = ("esd@source", "esd@other")  # dispatched once: rank 0 for all, and rank 1
    policies = {t: plain + (once if t == "current" else ()) for t in trees}
    rates = {t: {p: [] for p in policies[t]} for t in trees}
    cpu: dict[str, dict[str, list[float]]] = {t: {p: [] for p in policies[t]} for t in trees}
    for r in range(args.read_repeats):
        for tree in list(trees)[r % len(trees) :] + list(trees)[: r % len(trees)]:
            mine = policies[tree]
            for policy in mine[r % len(mine) :] + mine[: r % len(mine)]:
                argv = [sys.executable, "-c", _READ_RATE, str(dataset), policy, str(args.ranks),
                        str(args.micro_batch), str(args.read_steps), "1", str(cache_rows),
                        ",".join(f"{b:g}" for b in bandwidth)]  # fmt: skip
                env = {**os.environ, "PYTHONPATH": str(trees[tree]), "OMP_NUM_THREADS": "1"}
                done = subprocess.run(argv, capture_output=True, text=True, env=env,
                                      cwd=trees[tree], timeout=1800)  # fmt: skip
                if done.returncode != 0:
                    sys.exit(f"reading with {policy} in {trees[tree]} failed:\n"
                             f"{done.stderr[-3000:]}")  # fmt: skip
                ((rate, cpu_s),) = json.loads(done.stdout.strip().splitlines()[-1])
                rates[tree][policy].append(rate)
                cpu[tree][policy].append(cpu_s * 1e3)
    out: dict[str, Any] = {"ranks": args.ranks, "micro_batch": args.micro_batch,
                           "steps": args.read_steps, "trees": {t: str(p) for t, p in trees.items()}}  # fmt: skip
    for tree in trees:
        med = {p: statistics.median(v) for p, v in rates[tree].items()}
        out[tree] = {
            "samples_per_s": {p: spread(v) for p, v in rates[tree].items()},
            "cpu_ms_per_step": {p: spread(v) for p, v in cpu[tree].items()},
            "esd_vs_contiguous": med["esd"] / med["contiguous"],
            "random_vs_contiguous": med["random"] / med["contiguous"],
            # what dispatching adds to a rank's step (CPU), over the contiguous cut's reading
            "dispatch_overhead_ms_per_step": statistics.median(cpu[tree]["esd"])
            - statistics.median(cpu[tree]["contiguous"]),
        }
        if "esd@source" in cpu[tree]:  # dispatched once: what each rank adds to the cut's
            base = statistics.median(cpu[tree]["contiguous"])
            out[tree]["once_overhead_ms_per_step"] = {
                role: statistics.median(cpu[tree][f"esd@{role}"]) - base
                for role in ("source", "other")
            }
    if "baseline" in trees:
        out["esd_samples_per_s_vs_baseline"] = statistics.median(
            rates["current"]["esd"]
        ) / statistics.median(rates["baseline"]["esd"])
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    if args.data:
        datasets = {"data": args.data}
    else:
        datasets = build_datasets(work, requests=args.requests, seed=args.seed, orders=orders)
    per_order = {label: replay_order(path, args, label=label) for label, path in datasets.items()}
    head = per_order[next(iter(per_order))]
    reading = None
    if args.read_steps:
        reading = read_rates(next(iter(datasets.values())), args,
                             cache_rows=head["dataset"]["cache_rows"])  # fmt: skip
    training = None
    if args.train_steps:
        cache_rows = head["dataset"]["cache_rows"]
        training = train_rates(next(iter(datasets.values())), args, work, cache_rows=cache_rows)
    figures = ("cost_vs_laia_alpha1", "cost_vs_laia_alpha0", "cost_order_holds",
               "dispatch_vs_saved", "dispatch_vs_saved_10gbit", "per_rank_cut_vs_saved",
               "per_rank_cut_vs_saved_10gbit", "dispatch_vs_saved_cluster_rates",
               "per_rank_cut_vs_saved_cluster_rates")  # fmt: skip
    return {
        "setting": {
            "ranks": args.ranks,
            "fast_ranks": args.fast_ranks,
            "fast_factor": args.fast_factor,
            "slow_bandwidth_bytes_s": args.bandwidth,
            "micro_batch": args.micro_batch,
            "max_piece_rows": args.piece_rows,
            "row_bytes": 4 * (args.dim + 1),
            "cache_share": args.cache_share,
            "hot_share": args.hot_share,
            "shuffle": args.shuffle,
            "requests": None if args.data else args.requests,
            "headline_order": next(iter(per_order)),
        },
        **{k: head[k] for k in figures},
        "cost": {name: r["cost"] for name, r in head["cost_s"].items()},
        "dispatch_ms_alpha1": head["dispatch_ms"]["esd_alpha1"]["wall"]["median"],
        "dispatch_ms_alpha1_spread": head["dispatch_ms"]["esd_alpha1"]["wall"],
        "dispatch_cpu_ms_alpha1": head["dispatch_ms"]["esd_alpha1"]["cpu"]["median"],
        "orders": per_order,
        "reading": reading,
        "training": training,
        **(
            {}
            if training is None
            else {
                "train_esd_vs_random": training["esd_vs_random"],
                "train_esd_vs_random_repeats": training["esd_vs_random_repeats"],
                "train_cache_cost_esd_vs_random": training["cache_cost_esd_vs_random"],
            }
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="recpipe-dispatch-") as tmp:
        work = args.work or Path(tmp)
        results = run(args, work)
    out = write_results(results, args.out)
    for label, res in results["orders"].items():
        print(f"{label} order: {res['dataset']}")
        print(
            f"  {'policy':<14}{'cost s':>10}{'all s':>10}{'hits':>7}{'step s':>9}{'ms/batch':>10}"
        )
        for name, r in res["cost_s"].items():
            ms = res["dispatch_ms"][name]["wall"]["median"]
            print(f"  {name:<14}{r['cost']:>10.3f}{r['all']:>10.3f}{r['hit_rate']:>7.3f}"
                  f"{r['step_transfer_s']:>9.4f}{ms:>10.2f}")  # fmt: skip
        print(f"  cost_vs_laia_alpha1 {res['cost_vs_laia_alpha1']:.3f} (target <= 0.70), "
              f"cost_vs_laia_alpha0 {res['cost_vs_laia_alpha0']:.3f}, "
              f"order holds: {res['cost_order_holds']}, "
              f"dispatch_vs_saved {res['dispatch_vs_saved']:.3f} (target < 1)")  # fmt: skip
    training = results["training"]
    if training is not None:
        rates = training["samples_per_s"]
        print(f"recpipe train, {training['ranks']} ranks: esd {rates['esd']['median']:.0f}, "
              f"random {rates['random']['median']:.0f} samples/s "
              f"(esd_vs_random {training['esd_vs_random']:.3f}); the caches' pulls and pushes, "
              f"esd / random link seconds: {training['cache_cost_esd_vs_random']:.3f}")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
