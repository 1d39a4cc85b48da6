"""Scale-out wins as wall time over shaped links: a cluster in a box (`recpipe.testing.cluster`).

Two namespace hosts joined through a bridge namespace, each host's link shaped with tbf to
`--rate-mbit` each way; one rank per host (gloo on the host's link, `GLOO_SOCKET_IFNAME`).
Needs root (network namespaces); elsewhere it stops with the reason.

Figures (written to benchmarks/results/cluster.json), each with its spread over alternated
repeats (`_common.alternate`: the cases' order rotates every repeat; rank 0's wall time):
  hypereca_best_r_vs_r0     2 hosts x 1 rank: global samples/s at the best hot-set size R
                            measured / at R = 0 (HypeReca reports 1.6x-7.8x). Target >= 1.5
  hypereca_chosen_vs_best   samples/s at the best R measured / at the R the cost model picks,
                            the model fitted at start-up on the shaped group. Target <= 1.05
  where the time goes       per R: the step's wall time, rank 0's CPU time in it (the rest is
                            waiting on the link), and the bytes each step moves by all-to-all
                            and by the hot rows' all-reduce (counted by the exchange) and by
                            DDP's all-reduce of the dense gradients (their size), with the
                            time they need at the link's rate
  hypereca_best_nonzero_r_vs_r0  the best R > 0 measured / R = 0 (below 1: a hot set costs)
  unshaped                  the same job right after in the same cluster, links unshaped:
                            samples/s by R, and the share of the shaped R = 0 step that the
                            link costs (1 - unshaped step / shaped step)
  collectives_ms            one all-to-all sending the other rank 64 KiB, 256 KiB, 1 MiB (both
                            ways at once), and a 4-byte all-reduce, shaped and unshaped, beside
                            the time the bytes need one way at the rate
  service_ikjt_vs_kjt_samples_per_s  3 hosts at `--service-rate-mbit`: the reader service on
                            host 2, a client rank on hosts 0 and 1 reading its shard of an
                            epoch (no training):
                            samples/s delivered with IKJT frames / with KJT frames, with the
                            bytes per sample and the samples/s the link allows. Target >= 1.3
  link_measured_mbit        a plain TCP transfer between the hosts before the job (the shaping
                            holds: never above the rate)
  vs_torchrec_dmp_shaped    (`--torchrec`, report) the same job's samples/s at the chosen R /
                            TorchRec DMP's (table-wise; `benchmarks/distributed.py`'s
                            torchrec_dmp case) on the same batches, alternated with the R
                            cases; `unshaped.vs_torchrec_dmp` the same with the links unshaped

The rank's work is `benchmarks/distributed.py`'s (its batches, model and trainer); the rate is
chosen so that the R = 0 step's all-to-all needs several times the step's compute on the wire
(docs/distributed.md, "Cluster in a box").

Part dmt (`--only dmt`): real `recpipe train --towers` jobs (`python -m trainer` on every rank),
2 hosts x 2 ranks (ranks of a host on its loopback, unshaped; the hosts' links at
`--dmt-rate-mbit`), on `etl.synth`'s default schema (no planted groups), 12 of its 13 features
in 2 towers (user + device: 8 on host 0, item: 4 on host 1), every case on the same batches:
  dmt_sptt_tm_vs_flat       steady samples/s of SPTT with DLRM tower modules at compression 4 /
                            the flat schedule (`--schedule flat`: the same towered model with
                            pass-through towers, the tables on the same hosts, TorchRec's
                            table-wise all-to-all of pooled embeddings). Target >= 1.5
  dmt_sptt_vs_flat          plain SPTT (pass-through towers) / the flat schedule
  dmt_auc_delta             held-out AUC of the towers model - of flat after the same steps,
                            repeat i trained with seed i (the spread is over seeds). >= -0.002
Part esd (`--only esd`): 4 hosts x 1 rank, hosts 0, 1 at 10x `--esd-rate-mbit`, hosts 2, 3 at
it (ESD's 5 / 0.5 Gbit/s scaled down), every rank with a `--cache-rows` cache, `--bandwidths`
the links' rates:
  esd_vs_laia_samples_per_s steady samples/s of `--dispatch esd --alpha 1` / `--dispatch laia`
                            (target >= 1.3); also esd / random and esd alpha 0 / laia
Part service-train (`--only service-train`): 3 hosts, the reader service on host 2 (a server
of IKJT frames and one of plain KJT frames, shuffled with `--seed`) on a link shaped to
`--service-rate-mbit`, 2 ranks of `recpipe train --service` on hosts 0 and 1
(`--service-batch-size` rows per rank; their links unshaped unless `--service-rank-rate-mbit`,
so the step waits on the service's link, not on the ranks' own collectives):
  service_ikjt_vs_kjt_train_samples_per_s  steady samples/s trained with IKJT frames (`--dedup
                            on` at both ends) / with KJT frames (`--dedup off`: the model
                            deduplicates, the same losses), alternated (`--service-repeats`),
                            with the bytes per sample the service host sent, the samples/s
                            its link allows, and the step shaped / unshaped. Target >= 1.3
All three parts run their cases once more with the links unshaped (the link's share of each
step), and count what crosses hosts (the towers' traffic, the caches' transfers per rank, the
service host's frames).
Steady samples/s: rank 0's per-step records (`--metrics`) after the first 3 steps.

`--only PART,...` measures those parts alone and keeps the other parts' figures already in
`--out`; `not_measured` names the figures the file does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import ratio_spread, spread, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cluster.json"
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {
    "hypereca_best_r_vs_r0": 1.5,
    "hypereca_chosen_vs_best": 1.05,
    "dmt_sptt_tm_vs_flat": 1.5,
    "dmt_auc_delta": -0.002,
    "esd_vs_laia_samples_per_s": 1.3,
}
PARTS = ("hypereca", "dmt", "esd", "service-train")
# every figure of the issue, and the part that measures it (None: no part does yet)
FIGURE_PARTS = {
    "hypereca_best_r_vs_r0": "hypereca",
    "hypereca_chosen_vs_best": "hypereca",
    "service_ikjt_vs_kjt_samples_per_s": "hypereca",
    "dmt_sptt_tm_vs_flat": "dmt",
    "dmt_auc_delta": "dmt",
    "esd_vs_laia_samples_per_s": "esd",
    "service_ikjt_vs_kjt_train_samples_per_s": "service-train",
    "vs_torchrec_dmp_shaped": "hypereca",
    "dispatch_vs_saved": None,
}
# figures another benchmark measures at this harness's rates, and where they are
ELSEWHERE = {
    "dispatch_vs_saved": "benchmarks/results/dispatch.json: dispatch_vs_saved_cluster_rates "
    "(the dispatcher replayed at this harness's ESD rates, 100 and 10 Mbit/s) and "
    "dispatch_vs_saved_10gbit",
}

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="each host's link, Mbit/s")
    parser.add_argument("--requests", type=int, default=20_000, help="synthetic requests")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per rank per step")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches per rank")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="alternated repeats per case")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table")
    parser.add_argument("--probe-rows", type=int, default=4096, help="largest cost probe")
    parser.add_argument(
        "--service",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the reader service (3 hosts)",
    )
    parser.add_argument(
        "--torchrec",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time TorchRec DMP beside the R cases (vs_torchrec_dmp_shaped)",
    )
    parser.add_argument(
        "--service-rate-mbit", type=float, default=20.0,
        help="each host's link in the reader-service measurement, Mbit/s",
    )  # fmt: skip
    parser.add_argument(
        "--service-batch-size", type=int, default=512, help="rows per batch the service sends"
    )
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="the whole job's deadline")
    parser.add_argument(
        "--only", type=_parts, default=PARTS,
        help="comma-separated parts to measure, of " + ", ".join(PARTS) + " (default: all); "
        "the others' figures already in `--out` are kept",
    )  # fmt: skip
    dmt = parser.add_argument_group("dmt (2 hosts x 2 ranks, `recpipe train --towers`)")
    dmt.add_argument("--dmt-rate-mbit", type=float, default=20.0, help="each host's link, Mbit/s")
    dmt.add_argument("--dmt-requests", type=int, default=60_000, help="synthetic requests")
    dmt.add_argument("--dmt-steps", type=int, default=40, help="training steps per run")
    dmt.add_argument("--dmt-batch-size", type=int, default=256, help="rows per rank per step")
    dmt.add_argument("--dmt-embedding-dim", type=int, default=64)
    dmt.add_argument("--dmt-repeats", type=int, default=2,
                     help="alternated repeats (repeat i trains with --seed i)")  # fmt: skip
    st = parser.add_argument_group(
        "service-train (3 hosts: `recpipe train --service` on 2, the service on the third, "
        "at --service-rate-mbit, --service-batch-size rows per rank)")  # fmt: skip
    st.add_argument("--service-steps", type=int, default=40,
                    help="training steps per run (within one epoch of the data)")  # fmt: skip
    st.add_argument("--service-requests", type=int, default=60_000,
                    help="synthetic requests (`--data`: that dataset instead)")  # fmt: skip
    st.add_argument("--service-repeats", type=int, default=5, help="alternated repeats")
    st.add_argument(
        "--service-rank-rate-mbit", type=float, default=None,
        help="the 2 trainer hosts' links, Mbit/s (default: unshaped, so that the ranks' own "
        "all-to-alls and all-reduces do not wait on the link under test, the service's)",
    )  # fmt: skip
    esd = parser.add_argument_group("esd (4 hosts x 1 rank, `recpipe train --dispatch`)")
    esd.add_argument("--esd-rate-mbit", type=float, default=10.0,
                     help="the 2 slow hosts' links, Mbit/s (the 2 fast ones: 10x)")  # fmt: skip
    esd.add_argument("--esd-steps", type=int, default=20, help="training steps per run")
    esd.add_argument("--esd-batch-size", type=int, default=256, help="rows per rank per step")
    esd.add_argument("--esd-cache-rows", type=int, default=16_384, help="each rank's cache")
    esd.add_argument("--esd-embedding-dim", type=int, default=64)
    esd.add_argument("--esd-repeats", type=int, default=2, help="alternated repeats")
    parser.add_argument("--data", type=Path, help="an existing clustered dataset (skip synth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank: JSON options
    return parser.parse_args(argv)


# -- one rank (inside a namespace host) ---------------------------------------------------------
def _hypereca_rank(options: dict[str, Any]) -> None:
    import torch

    from benchmarks._common import alternate
    from benchmarks.distributed import _batches, _line, _ours
    from trainer.distributed.comm import destroy, init_from_env
    from trainer.distributed.costs import choose_num_hot, fit_costs

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=600.0)
    dataset, steps = options["dataset"], options["steps"]
    batches = _batches(dataset, options, rank=comm.rank, world=comm.world_size, dedup=True)
    top = options["probe_rows"]
    probe = [max(top // k, 1) for k in (64, 16, 4, 1)]
    t0 = time.perf_counter()
    fit = fit_costs(comm, dim=options["embedding_dim"], ar_rows=probe, a2a_rows=probe,
                    repeats=3, rounds=3, warm=1)  # fmt: skip
    probe_s = time.perf_counter() - t0
    base = _ours(dataset, options, comm)
    for batch in batches:
        base.sparse.count(batch)
    candidates = base.sparse.gather_counts(budget=1 << 24)
    plan = choose_num_hot(candidates, fit)
    everything = int(candidates.counts.size)
    sizes = sorted({0, plan.num_hot, everything // 256, everything // 64, everything // 16})
    trainers = {}
    for r in sizes:
        trainer = base if r == 0 else _ours(dataset, options, comm)
        trainer.sparse.candidates, trainer.sparse.count_left = candidates, 0
        trainer.sparse.reshard(r)
        trainers[r] = trainer

    def case(trainer: Any) -> Any:
        def run() -> None:
            comm.barrier(what="benchmark")
            for k in range(steps):
                trainer.train_step(batches[k % len(batches)], reduce_loss=False)
            trainer.pending_losses()

        return run

    cases = {f"R={r}": case(t) for r, t in trainers.items()}
    if options.get("torchrec"):
        cases["torchrec_dmp"] = _torchrec_case(dataset, options, comm)
    for trainer in trainers.values():
        trainer.sparse.stats = type(trainer.sparse.stats)()
    runs = alternate(cases, repeats=options["repeats"])
    totals = {}
    for r, trainer in trainers.items():
        stats = trainer.sparse.stats.as_tensor()
        comm.all_reduce(stats, what="benchmark")
        totals[str(r)] = dict(zip(type(trainer.sparse.stats).__dataclass_fields__, stats.tolist(),
                                  strict=True))  # fmt: skip
    rho = candidates.rho()
    cpu = {name: [t.cpu_s for t in ts] for name, ts in runs.items()}
    Path(f"{options['out']}.cpu-{comm.rank}").write_text(json.dumps(cpu))  # every rank's
    # what DDP all-reduces every step besides the exchange: the dense gradients
    dense_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters()
                      if p.requires_grad)  # fmt: skip
    if comm.rank == 0:
        raw = {
            "runs": {name: [[t.wall_s, t.cpu_s] for t in ts] for name, ts in runs.items()},
            "sizes": sizes,
            "chosen": plan.num_hot,
            "all_rows": everything,
            "rho": {str(r): float(rho[min(r, rho.size - 1)]) for r in sizes},
            "accesses_per_step": float(candidates.accesses_per_step),
            "predicted_cost_s": {
                str(r): float(fit.cost(r, rho[min(r, rho.size - 1)], candidates.accesses_per_step))
                for r in sizes
            },
            "fit": {
                **{n: _line(getattr(fit, n)) for n in ("all_reduce", "all_to_all", "hot_lookup")},
                "c_ar": fit.c_ar,
                "c_a2a": fit.c_a2a,
                "r2": fit.r2,
            },
            "probe_s": probe_s,
            "dense_grad_bytes": dense_bytes,
            "exchange": totals,
            "world": comm.world_size,
        }
        Path(options["out"]).write_text(json.dumps(raw))
    comm.barrier(what="benchmark")
    destroy()


def _torchrec_case(dataset: str, options: dict[str, Any], comm: Any) -> Any:
    """``options["steps"]`` steps of TorchRec DMP (table-wise) on this rank's plain batches:
    `benchmarks/distributed.py`'s torchrec_dmp case."""
    import torch.nn.functional as F

    from benchmarks.distributed import _batches, _torchrec_dmp
    from recpipe.torchrec_interop import to_torchrec

    dmp, opt = _torchrec_dmp(dataset, options)
    plain = [(b.dense, to_torchrec(b.to_plain().kjt), b.labels)
             for b in _batches(dataset, options, rank=comm.rank, world=comm.world_size,
                               dedup=False)]  # fmt: skip

    def run() -> None:
        comm.barrier(what="benchmark")
        for k in range(options["steps"]):
            dense, kjt, labels = plain[k % len(plain)]
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(dmp(dense, kjt), labels).backward()
            opt.step()

    return run


def _collectives_rank(options: dict[str, Any]) -> None:
    """Median seconds of single collectives on the job's group: a 4-byte all-reduce (the
    round trip) and all-to-alls sending each other rank ``size`` bytes (both ways at once)."""
    import statistics

    import torch
    import torch.distributed as dist

    from trainer.distributed.comm import destroy, init_from_env

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=120.0)
    out: dict[str, float] = {}
    for size in (4, *options["a2a_bytes"]):
        n = max(size // 4, 1)
        times = []
        for _ in range(options["repeats"]):
            send = torch.zeros(n * comm.world_size)
            recv = torch.empty_like(send)
            dist.barrier(group=comm.group)
            t0 = time.perf_counter()
            if size == 4:
                dist.all_reduce(send[:1], group=comm.group)
            else:
                dist.all_to_all_single(recv, send, group=comm.group)
            times.append(time.perf_counter() - t0)
        out["all_reduce_4" if size == 4 else f"all_to_all_{size}"] = statistics.median(times)
    if comm.rank == 0:
        Path(options["out"]).write_text(json.dumps(out))
    comm.barrier(what="benchmark")
    destroy()


_TOKEN = "cluster-in-a-box"  # the service's shared secret (its hosts are the run's own)


def _serve_rank(options: dict[str, Any]) -> None:
    """The reader service on its host: one server of IKJT frames (``--dedup on``) and one of
    plain KJT frames (``--dedup off``) over the same dataset, until killed; writes ``out`` once
    both listen."""
    import io

    from readers.service import DatasetProducer, ReaderServer, ServiceConfig

    address = options["address"]
    servers = {}
    for name, dedup in (("ikjt", True), ("kjt", False)):
        producer = DatasetProducer(options["dataset"], batch_size=options["batch_size"],
                                   dedup=dedup, shuffle=options.get("shuffle", False),
                                   seed=options.get("seed", 0))  # fmt: skip
        config = ServiceConfig(host=address, port=options["ports"][name], token=_TOKEN,
                               readers=1, idle_readers=2, report_every_s=0)  # fmt: skip
        servers[name] = ReaderServer(producer, config=config, log=io.StringIO()).start()
    Path(options["out"]).write_text(json.dumps({n: list(s.address) for n, s in servers.items()}))
    while True:
        time.sleep(3600)


def _feed_rank(options: dict[str, Any]) -> None:
    """A client rank: reads its share of an epoch from each server, alternated; its steady
    samples/s per repeat (the ranks start each read together)."""
    import torch

    from benchmarks._common import alternate
    from benchmarks.service import _timed
    from readers.service import ServiceClient
    from trainer.distributed.comm import destroy, init_from_env

    torch.set_num_threads(1)
    comm = init_from_env(device="cpu", timeout_s=300.0)

    def case(name: str) -> Any:
        host, port = options["servers"][name]

        def run() -> dict[str, float]:
            client = ServiceClient(host, port, token=_TOKEN, shard=comm.rank,
                                   num_shards=comm.world_size, read_timeout_s=120)  # fmt: skip
            comm.barrier(what="benchmark")
            t0 = time.monotonic()  # one clock for every namespace: the ranks' windows compare
            try:
                figures = _timed(iter(client), None, lambda: client.bytes_received,
                                 cpu=time.process_time)  # fmt: skip
            finally:
                client.close()
            return {**figures, "first_at": t0 + figures["startup_s"], "end_at": time.monotonic()}

        return run

    runs = alternate({n: case(n) for n in ("ikjt", "kjt")}, repeats=options["repeats"])
    out = {n: [t.value for t in ts] for n, ts in runs.items()}
    Path(f"{options['out']}.{comm.rank}").write_text(json.dumps(out))
    comm.barrier(what="benchmark")
    destroy()


# -- the job ------------------------------------------------------------------------------------
def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cluster's `with`: namespaces removed


def _rank_env() -> dict[str, str]:
    """A rank's environment: this checkout importable, one thread per rank (2 shared cores)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def _job(cluster: Any, options: dict[str, Any], work: Path, *, timeout_s: float) -> None:
    """Run ``_<kind>_rank(options)`` on 2 ranks, rank k on host k."""
    from recpipe.testing.cluster import wait_all

    argv = [sys.executable, "-m", "benchmarks.cluster", "--worker", json.dumps(options)]
    procs = cluster.launch(argv, [0, 1], env=_rank_env(), logs=work)
    codes = wait_all(procs, timeout_s=timeout_s)
    if codes != [0, 0]:
        tails = "\n".join(f"-- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                          for p in sorted(work.glob("rank-*.log")))  # fmt: skip
        msg = f"the {options['kind']} ranks exited with {codes} (None: killed at the deadline)"
        raise RuntimeError(f"{msg}\n{tails}")


def _collectives(cluster: Any, work: Path, *, name: str) -> dict:
    raw_path = work / f"{name}.json"
    options = {"kind": "collectives", "a2a_bytes": [64 << 10, 256 << 10, 1 << 20],
               "repeats": 9, "out": str(raw_path)}  # fmt: skip
    _job(cluster, options, work, timeout_s=300.0)
    return json.loads(raw_path.read_text())


def _start_service(cluster: Any, dataset: Path, batch_size: int, work: Path,
                   **reader: Any) -> dict[str, list[Any]]:  # fmt: skip
    """The reader service (`_serve_rank`) on the cluster's last host, ``reader`` its
    `DatasetProducer` options besides the batch size (``shuffle``, ``seed``); killed with the
    cluster. Its servers' ``{"ikjt": [host, port], "kjt": [host, port]}`` once they listen."""
    ready = work / "servers.json"
    serve = {"kind": "serve", "dataset": str(dataset), "batch_size": batch_size,
             "address": cluster.hosts[-1].address, "ports": {"ikjt": 7001, "kjt": 7002},
             "out": str(ready), **reader}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    argv = [sys.executable, "-m", "benchmarks.cluster", "--worker", json.dumps(serve)]
    with (work / "server.log").open("wb") as log:
        server = cluster.popen(len(cluster.hosts) - 1, argv, env=env, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 300.0
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            tail = (work / "server.log").read_text(errors="replace")[-3000:]
            msg = f"the reader service did not start (exit {server.poll()})\n{tail}"
            raise RuntimeError(msg)
        time.sleep(0.2)
    return json.loads(ready.read_text())


def _fed(out: Path, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """What the 2 `_feed_rank`s wrote to ``out``: per frame kind, the samples/s delivered to
    both ranks together in each repeat (from the first rank's first batch to the last rank's
    last), and the frames' bytes per sample (the clients' count, the first repeat)."""
    ranks = [json.loads(Path(f"{out}.{k}").read_text()) for k in (0, 1)]
    rates = {}
    for name in ("ikjt", "kjt"):
        rates[name] = [
            sum(r[name][i]["samples_after_first"] for r in ranks)
            / (max(r[name][i]["end_at"] for r in ranks)
               - min(r[name][i]["first_at"] for r in ranks))
            for i in range(repeats)
        ]  # fmt: skip
    per_sample = {n: sum(r[n][0]["bytes_after_first"] for r in ranks)
                  / sum(r[n][0]["samples_after_first"] for r in ranks) for n in rates}  # fmt: skip
    return rates, per_sample


def _service(dataset: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """3 hosts at ``--rate-mbit``: the reader service on host 2, a client rank on hosts 0, 1."""
    from recpipe.testing.cluster import Cluster

    with Cluster([args.service_rate_mbit] * 3) as cluster:
        servers = _start_service(cluster, dataset, args.service_batch_size, work)
        feed = {"kind": "feed", "servers": servers, "repeats": args.repeats,
                "out": str(work / "feed.json")}  # fmt: skip
        _job(cluster, feed, work, timeout_s=args.timeout_s)
        topology = cluster.describe()
    rates, per_sample = _fed(work / "feed.json", args.repeats)
    ratio = ratio_spread(rates["ikjt"], rates["kjt"])
    link = args.service_rate_mbit * 1e6 / 8
    return {
        "service_ikjt_vs_kjt_samples_per_s": {
            "median": ratio["median"],
            "wall": ratio,
            "target": 1.3,
            "met": ratio["median"] >= 1.3,
            "what": "feed only: samples/s the service on its own host delivers to 2 client "
            "ranks on 2 other hosts (each reads its shard of an epoch), no training",
        },
        "service": {
            "topology": topology,
            "samples_per_s": {n: spread(v) for n, v in rates.items()},
            "bytes_per_sample": per_sample,
            "link_bound_samples_per_s": {n: link / b for n, b in per_sample.items()},
            # the service host's upload carries both ranks' frames: its use of the link
            "link_use": {n: spread(v)["median"] * per_sample[n] / link for n, v in rates.items()},
            "rate_mbit": args.service_rate_mbit,
            "batch_size": args.service_batch_size,
        },
    }


def _hypereca(
    cluster: Any, dataset: Path, args: argparse.Namespace, work: Path, *, name: str
) -> dict:
    raw_path = work / f"{name}.json"
    options = {
        k: getattr(args, k)
        for k in (
            "batch_size",
            "batches",
            "steps",
            "repeats",
            "embedding_dim",
            "num_embeddings",
            "probe_rows",
        )
    }
    options.update(kind="hypereca", dataset=str(dataset), out=str(raw_path),
                   torchrec=args.torchrec)  # fmt: skip
    _job(cluster, options, work, timeout_s=args.timeout_s)
    raw = json.loads(raw_path.read_text())
    raw["cpu_by_rank"] = [json.loads(Path(f"{raw_path}.cpu-{k}").read_text()) for k in (0, 1)]
    return raw


def _summarise_hypereca(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    world, steps = raw["world"], args.steps
    samples = world * args.batch_size * steps
    walls = {name: [w for w, _ in ts] for name, ts in raw["runs"].items()}
    cpus = {name: [c for _, c in ts] for name, ts in raw["runs"].items()}
    rates = {name: [samples / w for w in ws] for name, ws in walls.items()}
    sps = {int(name[2:]): spread(v)["median"] for name, v in rates.items() if name[:2] == "R="}
    best, chosen = max(sps, key=sps.get), raw["chosen"]
    link = args.rate_mbit * 1e6 / 8  # bytes/s each way per host
    where = {}
    for r in raw["sizes"]:
        ex = raw["exchange"][str(r)]
        rank_steps = max(ex["steps"], 1)  # summed over the ranks
        a2a, ar = ex["a2a_bytes"] / rank_steps, ex["allreduce_bytes"] / rank_steps
        where[str(r)] = {
            "step_s": spread([w / steps for w in walls[f"R={r}"]]),
            "rank0_cpu_s_per_step": spread([c / steps for c in cpus[f"R={r}"]]),
            "rank1_cpu_s_per_step": spread([c / steps for c in raw["cpu_by_rank"][1][f"R={r}"]]),
            "a2a_bytes_per_rank_step": a2a,
            "allreduce_bytes_per_rank_step": ar,
            # what a rank sends on its link: its all-to-all bytes to the others (counted so)
            # and 2(W-1)/W of the hot gradients it all-reduces (a ring): seconds at the rate
            "dense_allreduce_bytes_per_rank_step": raw["dense_grad_bytes"],
            "wire_s_at_rate": (a2a + ar * 2 * (world - 1) / world) / link,
            "dense_wire_s_at_rate": raw["dense_grad_bytes"] * 2 * (world - 1) / world / link,
            "rho": raw["rho"][str(r)],
        }

    def ratio(a: str, b: str) -> dict[str, Any]:
        return {"median": ratio_spread(rates[a], rates[b])["median"],
                "wall": ratio_spread(rates[a], rates[b]),
                "cpu": ratio_spread([samples / c for c in cpus[a]],
                                    [samples / c for c in cpus[b]])}  # fmt: skip

    best_vs_r0 = ratio(f"R={best}", "R=0")
    hot = {r: v for r, v in sps.items() if r > 0}
    best_hot = max(hot, key=hot.get) if hot else best
    chosen_vs_best = ratio(f"R={best}", f"R={chosen}")
    torchrec = {}
    if "torchrec_dmp" in rates:  # ours at the chosen R (as `recpipe train` would run) / theirs
        torchrec["vs_torchrec_dmp_shaped"] = {
            **ratio(f"R={chosen}", "torchrec_dmp"),
            "best_r": ratio(f"R={best}", "torchrec_dmp"),
            "r0": ratio("R=0", "torchrec_dmp"),
            "torchrec_dmp_samples_per_s": spread(rates["torchrec_dmp"]),
            "what": "2 hosts x 1 rank: ours at the chosen R / TorchRec DMP (table-wise, "
            "fused row-wise Adagrad), the same batches, alternated with the R cases",
        }
    return {
        **torchrec,
        "hypereca_best_r_vs_r0": {
            **best_vs_r0,
            "target": TARGETS["hypereca_best_r_vs_r0"],
            "met": best_vs_r0["median"] >= 1.5,
        },
        "hypereca_chosen_vs_best": {
            **chosen_vs_best,
            "target": TARGETS["hypereca_chosen_vs_best"],
            "met": chosen_vs_best["median"] <= 1.05,
        },
        # the best R > 0 / R = 0: what a hot set does to this job (below 1: it costs)
        "hypereca_best_nonzero_r_vs_r0": {**ratio(f"R={best_hot}", "R=0"), "r": best_hot},
        "hypereca": {
            "hosts": 2,
            "ranks_per_host": 1,
            "samples_per_s": {str(r): v for r, v in sorted(sps.items())},
            "samples_per_s_spread": {n: spread(v) for n, v in rates.items()},
            "best_measured_r": best,
            "chosen_r": chosen,
            "all_rows": raw["all_rows"],
            "accesses_per_step": raw["accesses_per_step"],
            "where_the_time_goes": where,
            "predicted_cost_s": raw["predicted_cost_s"],
            "cost_model": raw["fit"],
            "cost_probe_s": raw["probe_s"],
            "exchange": raw["exchange"],
        },
    }


def _unshaped(summary: dict[str, Any], shaped: dict[str, Any], args: argparse.Namespace) -> dict:
    """The same job right after, links unshaped (run, not alternated, with the shaped one):
    each R's step time there, and the share of the shaped R = 0 step the link costs."""
    where = summary["hypereca"]["where_the_time_goes"]
    step0 = spread([w / args.steps for w, _ in shaped["runs"]["R=0"]])["median"]
    return {
        "samples_per_s": summary["hypereca"]["samples_per_s"],
        "step_s": {r: w["step_s"]["median"] for r, w in where.items()},
        "rank0_cpu_s_per_step": {r: w["rank0_cpu_s_per_step"]["median"] for r, w in where.items()},
        "best_measured_r": summary["hypereca"]["best_measured_r"],
        "chosen_r": summary["hypereca"]["chosen_r"],
        "best_r_vs_r0": summary["hypereca_best_r_vs_r0"],
        "best_nonzero_r_vs_r0": summary["hypereca_best_nonzero_r_vs_r0"],
        **(
            {"vs_torchrec_dmp": summary["vs_torchrec_dmp_shaped"]}
            if "vs_torchrec_dmp_shaped" in summary
            else {}
        ),
        "link_share_of_r0_step": 1.0 - where["0"]["step_s"]["median"] / step0,
    }


# -- `recpipe train` jobs on the cluster (dmt, esd) ---------------------------------------------
WARM_STEPS = 3  # steps left out of a job's steady rate: the first step builds and compiles


def _parts(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in PARTS]
    if bad or not names:
        msg = f"`--only` takes parts of {', '.join(PARTS)}, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return names


def steady_rate(records: list[dict[str, Any]], *, warm: int = WARM_STEPS) -> dict[str, float]:
    """Samples/s and seconds per step of a run's training records (``--metrics``) after its
    first ``warm`` steps: the samples and the training wall time between step ``warm`` and the
    last step."""
    train = [r for r in records if r.get("kind") == "train"]
    if len(train) <= warm:
        msg = f"{len(train)} training steps recorded: more than {warm} are needed for a rate"
        raise ValueError(msg)
    first, last = train[warm - 1], train[-1]
    wall = last["wall_s"] - first["wall_s"]
    return {
        "samples_per_s": (last["samples"] - first["samples"]) / wall,
        "step_s": wall / (last["step"] - first["step"]),
    }


class _TrainJobs:
    """`recpipe train` jobs (`python -m trainer`, one process per rank, torchrun's variables
    from the cluster) on ``placement``; each job's rank-0 summary and steady rate."""

    def __init__(self, cluster: Any, placement: list[int], dataset: Path, common: list[str],
                 work: Path, *, timeout_s: float, env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.cluster, self.placement, self.work = cluster, placement, work
        self.common = [str(dataset), *common]
        self.timeout_s = timeout_s
        self.env = {**_rank_env(), **(env or {})}
        self.jobs = 0

    def __call__(self, name: str, flags: list[str]) -> dict[str, Any]:
        from recpipe.testing.cluster import wait_all

        self.jobs += 1
        out = self.work / f"{name}-{self.jobs}"
        out.mkdir(parents=True)
        summary, metrics = out / "summary.json", out / "metrics.jsonl"
        argv = [sys.executable, "-m", "trainer", *self.common, *flags, "--threads", "1",
                "--quiet", "--json", str(summary), "--metrics", str(metrics)]  # fmt: skip
        port = 29500 + self.jobs % 500  # a fresh port per job: no wait on the last one's
        before = _link_counters(self.cluster)
        procs = self.cluster.launch(argv, self.placement, env=self.env, logs=out, port=port)
        codes = wait_all(procs, timeout_s=self.timeout_s)
        moved = [[a - b for a, b in zip(x, y, strict=True)]
                 for x, y in zip(_link_counters(self.cluster), before, strict=True)]  # fmt: skip
        if any(c != 0 for c in codes):
            tails = "\n".join(f"-- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                              for p in sorted(out.glob("rank-*.log")))  # fmt: skip
            msg = f"`{name}` ({' '.join(flags)}) ranks exited with {codes} (None: deadline)"
            raise RuntimeError(f"{msg}\n{tails}")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        return {"summary": json.loads(summary.read_text()), "link_bytes": moved,
                **steady_rate(records)}  # fmt: skip

    def alternated(self, cases: dict[str, list[str]], *, repeats: int, seed: int,
                   same_seed: bool = False) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
        """Every case ``repeats`` times, the order rotating every repeat (``alternate``);
        repeat i of every case trains with ``--seed seed + i`` (``same_seed``: ``seed``)."""
        from benchmarks._common import alternate

        def case(name: str) -> Any:
            done = [0]

            def run() -> dict[str, Any]:
                job = self(name, [*cases[name], "--seed", str(seed + done[0] * (not same_seed))])
                done[0] += 1
                return job

            return run

        runs = alternate({n: case(n) for n in cases}, repeats=repeats, warmup=False)
        return {n: [t.value for t in ts] for n, ts in runs.items()}


def _link_counters(cluster: Any) -> list[list[int]]:
    """Bytes each host's link interface has sent and received so far: ``[[tx, rx], ...]``."""
    from recpipe.testing.cluster import INTERFACE

    out = []
    for host in cluster.hosts:
        argv = ["ip", "-n", host.namespace, "-s", "-j", "link", "show", "dev", INTERFACE]
        stats = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True,
                                          timeout=30).stdout)[0]["stats64"]  # fmt: skip
        out.append([int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])])
    return out


def _wire(jobs: list[dict[str, Any]], steps: int, rates_mbit: list[float]) -> dict[str, Any]:
    """What each host's link carried in a case's first repeat (every step, the start-up and
    the final evaluation included), per step, and the seconds per step its busier direction
    needs at the link's rate."""
    moved = jobs[0]["link_bytes"]
    return {
        "link_mb_per_step_by_host": [[b / steps / 1e6 for b in tx_rx] for tx_rx in moved],
        "link_s_per_step_by_host": [max(tx_rx) / steps / (r * 1e6 / 8)
                                    for tx_rx, r in zip(moved, rates_mbit, strict=True)],
    }  # fmt: skip


def _link(cluster: Any, src: int, dst: int, rate_mbit: float) -> float:
    """Mbit/s of a plain TCP transfer of about a second's bytes at the rate."""
    nbytes = max(int(rate_mbit * 1e6 / 8), 1 << 20)
    return nbytes * 8 / cluster.transfer(src, dst, nbytes) / 1e6


def _rate_ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, Any]:
    sps = {n: [j["samples_per_s"] for j in runs[n]] for n in (a, b)}
    ratio = ratio_spread(sps[a], sps[b])
    return {"median": ratio["median"], "wall": ratio}


def _with_target(name: str, figure: dict[str, Any]) -> dict[str, Any]:
    """``figure`` with its target (met: median >= target)."""
    return {**figure, "target": TARGETS[name], "met": figure["median"] >= TARGETS[name]}


def _step_where(jobs: list[dict[str, Any]], unshaped: dict[str, Any]) -> dict[str, Any]:
    """A case's seconds per step shaped (over the repeats) and unshaped (once), and the share
    of the shaped step that the link costs."""
    step = spread([j["step_s"] for j in jobs])
    return {
        "step_s": step,
        "unshaped_step_s": unshaped["step_s"],
        "link_share_of_step": 1.0 - unshaped["step_s"] / step["median"],
    }


# the towers of the dmt part: tower 0 the user's features and the device on host 0, tower 1
# the item's on host 1 (8 and 4 features, so that compression 4 divides both;
# `context_surface` is left out of every model of the part)
DMT_TOWERS = (
    ("user_segment", "user_country", "user_follows", "user_liked_items", "user_liked_sellers",
     "user_recent_queries", "user_recent_items", "context_device"),
    ("item_id", "item_seller", "item_category", "item_tags"),
)  # fmt: skip
DMT_CASES = {  # name -> `recpipe train` flags besides the common ones
    "sptt_tm": ["--tower-module", "dlrm", "--compression", "4"],
    "sptt": [],
    "flat": ["--schedule", "flat"],
}


def _dmt(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """2 hosts x 2 ranks at ``--dmt-rate-mbit``: SPTT with tower modules, plain SPTT and the
    flat table-wise schedule of the same towered model, alternated."""
    from benchmarks.distributed import build_dataset
    from recpipe.testing.cluster import Cluster
    from trainer.towers.config import TowerPlan

    dataset = build_dataset(work / "dmt-data", requests=args.dmt_requests, seed=args.seed)
    plan = work / "dmt-towers.toml"
    plan.write_text(TowerPlan(DMT_TOWERS, source="benchmarks/cluster.py").to_toml())
    common = ["--towers", str(plan), "--ranks-per-host", "2",
              "--features", ",".join(f for t in DMT_TOWERS for f in t),
              "--steps", str(args.dmt_steps), "--batch-size", str(args.dmt_batch_size),
              "--embedding-dim", str(args.dmt_embedding_dim), "--dist-timeout", "600"]  # fmt: skip
    rate = args.dmt_rate_mbit
    with Cluster([rate, rate]) as cluster:
        link = [_link(cluster, 0, 1, rate), _link(cluster, 1, 0, rate)]
        topology = cluster.describe()
        jobs = _TrainJobs(cluster, [0, 0, 1, 1], dataset, common, work / "dmt",
                          timeout_s=args.timeout_s)  # fmt: skip
        runs = jobs.alternated(DMT_CASES, repeats=args.dmt_repeats, seed=args.seed)
        for host in (0, 1):  # the same jobs once with the links unshaped: the link's share
            cluster.set_rate(host, None)
        unshaped = {n: jobs(n, [*f, "--seed", str(args.seed)]) for n, f in DMT_CASES.items()}
    global_batch = 4 * args.dmt_batch_size
    where = {}
    for name, jobs_ in runs.items():
        towers = jobs_[0]["summary"]["towers"]
        per_sample = towers["cross_host_bytes_per_sample"]
        where[name] = {
            **_step_where(jobs_, unshaped[name]),
            **_wire(jobs_, args.dmt_steps, [rate, rate]),
            "cross_host_bytes_per_sample": per_sample,
            # each host's link carries its half of the bytes that cross hosts, each way
            "wire_s_per_step_at_rate": per_sample * global_batch / 2 / (rate * 1e6 / 8),
            "traffic_bytes": {k: v["cross_host"] for k, v in towers["traffic"].items()},
            "flops_per_sample": towers["flops"]["total"],
        }
    aucs = {n: [j["summary"]["eval_auc"] for j in js] for n, js in runs.items()}
    deltas = [a - b for a, b in zip(aucs["sptt_tm"], aucs["flat"], strict=True)]
    auc_delta = {
        "median": spread(deltas)["median"],
        "by_seed": spread(deltas),
        "what": "held-out AUC of sptt_tm - of flat after the same steps, seed i in repeat i",
    }
    tm_vs_flat = _with_target("dmt_sptt_tm_vs_flat", _rate_ratio(runs, "sptt_tm", "flat"))
    return {
        "dmt_sptt_tm_vs_flat": tm_vs_flat,
        "dmt_sptt_vs_flat": _rate_ratio(runs, "sptt", "flat"),
        "dmt_auc_delta": _with_target("dmt_auc_delta", auc_delta),
        "dmt": {
            "hosts": 2,
            "ranks_per_host": 2,
            "rate_mbit": rate,
            "link_measured_mbit": link,
            "topology": topology,
            "cases": {
                n: " ".join(f) or "(pass-through towers, schedule sptt)"
                for n, f in DMT_CASES.items()
            },
            "flat_is": "the same towered model (pass-through towers) and tables on the same "
            "hosts, `--schedule flat`: TorchRec's table-wise all-to-all of pooled embeddings",
            "data": f"etl.synth's default schema, {args.dmt_requests} requests (seed "
            f"{args.seed}); no planted groups",
            "towers": [list(t) for t in DMT_TOWERS],
            "common_flags": common[2:],
            "samples_per_s": {
                n: spread([j["samples_per_s"] for j in js]) for n, js in runs.items()
            },
            "unshaped_samples_per_s": {n: j["samples_per_s"] for n, j in unshaped.items()},
            "eval_auc": aucs,
            "eval_samples": runs["flat"][0]["summary"]["eval_samples"],
            "where_the_time_goes": where,
            "steady_after_steps": WARM_STEPS,
        },
    }


ESD_CASES = {
    "esd_alpha1": ["--dispatch", "esd", "--alpha", "1"],
    "esd_alpha0": ["--dispatch", "esd", "--alpha", "0"],
    "laia": ["--dispatch", "laia"],
    "random": ["--dispatch", "random"],
}


def _esd(args: argparse.Namespace, dataset: Path, work: Path) -> dict[str, Any]:
    """4 hosts x 1 rank, hosts 0 and 1 at 10x ``--esd-rate-mbit``, hosts 2 and 3 at it; every
    rank with a cache; the dispatch policies alternated."""
    from recpipe.testing.cluster import Cluster

    slow = args.esd_rate_mbit
    rates = [10 * slow, 10 * slow, slow, slow]
    bandwidths = ",".join(f"{r * 1e6 / 8:g}" for r in rates)  # bytes/s, as the flag takes
    common = ["--cache-rows", str(args.esd_cache_rows), "--bandwidths", bandwidths,
              "--steps", str(args.esd_steps), "--batch-size", str(args.esd_batch_size),
              "--embedding-dim", str(args.esd_embedding_dim), "--dist-timeout", "600"]  # fmt: skip
    with Cluster(rates) as cluster:
        link = [_link(cluster, k, k ^ 1, r) for k, r in enumerate(rates)]  # to its twin
        topology = cluster.describe()
        jobs = _TrainJobs(cluster, [0, 1, 2, 3], dataset, common, work / "esd",
                          timeout_s=args.timeout_s)  # fmt: skip
        runs = jobs.alternated(ESD_CASES, repeats=args.esd_repeats, seed=args.seed)
        for host in range(4):
            cluster.set_rate(host, None)
        unshaped = {n: jobs(n, [*f, "--seed", str(args.seed)]) for n, f in ESD_CASES.items()}
    where = {}
    for name, jobs_ in runs.items():
        dist = jobs_[0]["summary"]["distributed"]
        where[name] = {
            **_step_where(jobs_, unshaped[name]),
            **_wire(jobs_, args.esd_steps, rates),
            "cache": dist["cache"],
            "reads_by_rank": [c["reads"] for c in dist["cache_per_rank"]],
            "transfers_by_rank": [
                c["pulls"] + c["pushes"] + c["evict_pushes"] + c["shared"]
                for c in dist["cache_per_rank"]
            ],
            "eval_auc": jobs_[0]["summary"]["eval_auc"],
        }
    esd_vs_laia = _rate_ratio(runs, "esd_alpha1", "laia")
    return {
        "esd_vs_laia_samples_per_s": _with_target("esd_vs_laia_samples_per_s", esd_vs_laia),
        "esd_vs_random_samples_per_s": _rate_ratio(runs, "esd_alpha1", "random"),
        "esd_alpha0_vs_laia_samples_per_s": _rate_ratio(runs, "esd_alpha0", "laia"),
        "esd": {
            "hosts": 4,
            "ranks_per_host": 1,
            "rates_mbit": rates,
            "link_measured_mbit": link,
            "topology": topology,
            "cases": {n: " ".join(f) for n, f in ESD_CASES.items()},
            # the homes `recpipe train --dispatch` gives the cost model (DispatchConfig.homes):
            # each row's owner rank, whose link a pull or push crosses too
            "cost_model_homes": "ranks",
            "common_flags": common,
            "samples_per_s": {
                n: spread([j["samples_per_s"] for j in js]) for n, js in runs.items()
            },
            "unshaped_samples_per_s": {n: j["samples_per_s"] for n, j in unshaped.items()},
            "where_the_time_goes": where,
            "steady_after_steps": WARM_STEPS,
        },
    }


SERVICE_TRAIN_CASES = {  # name -> `recpipe train` flags: the frames the trainer asks for
    "ikjt": ["--dedup", "on"],  # one IKJT per dedup group (the server's `--dedup on`)
    "kjt": ["--dedup", "off"],  # one plain KJT (`--dedup off`: the model deduplicates)
}


def _service_train(args: argparse.Namespace, dataset: Path | None, work: Path) -> dict[str, Any]:
    """The reader service on host 2, its link at ``--service-rate-mbit``, training 2 ranks of
    `recpipe train --service` on hosts 0 and 1, IKJT frames and plain KJT frames alternated,
    then once each with the links unshaped; on ``dataset`` (``None``: a synthetic one of
    ``--service-requests``)."""
    from recpipe.testing.cluster import Cluster

    if args.data is None:  # enough rows that the steps stay in one epoch (no reconnection)
        from benchmarks.distributed import build_dataset

        data = work / "service-data"
        dataset = build_dataset(data, requests=args.service_requests, seed=args.seed)
    rate, steps = args.service_rate_mbit, args.service_steps
    rates = [args.service_rank_rate_mbit, args.service_rank_rate_mbit, rate]
    batch = args.service_batch_size
    common = ["--steps", str(steps), "--batch-size", str(batch), "--eval-batches", "1",
              "--embedding-dim", str(args.embedding_dim), "--dist-timeout", "600"]  # fmt: skip
    with Cluster(rates) as cluster:
        link = [_link(cluster, 2, 0, rate), _link(cluster, 2, 1, rate)]
        topology = cluster.describe()
        # the server shuffles as the trainers expect (their `--shuffle` default, `--seed`)
        servers = _start_service(cluster, dataset, batch, work, shuffle=True, seed=args.seed)
        cases = {n: [*f, "--service", "{}:{}".format(*servers[n])]
                 for n, f in SERVICE_TRAIN_CASES.items()}  # fmt: skip
        jobs = _TrainJobs(cluster, [0, 1], dataset, common, work / "service-train",
                          timeout_s=args.timeout_s, env={"RECPIPE_TOKEN": _TOKEN})  # fmt: skip
        runs = jobs.alternated(cases, repeats=args.service_repeats, seed=args.seed,
                               same_seed=True)  # fmt: skip
        # the same servers feeding 2 client ranks that only read (an epoch's shard each, once):
        # the frames' bytes per sample as the clients count them, and the feed-only rate here
        feed = {"kind": "feed", "servers": servers, "repeats": 1,
                "out": str(work / "train-feed.json")}  # fmt: skip
        _job(cluster, feed, work, timeout_s=args.timeout_s)
        for host in range(3):  # the same jobs once with the links unshaped: the link's share
            cluster.set_rate(host, None)
        unshaped = {n: jobs(n, [*f, "--seed", str(args.seed)]) for n, f in cases.items()}
    global_batch = 2 * batch
    link_bytes = rate * 1e6 / 8
    sps = {n: [j["samples_per_s"] for j in js] for n, js in runs.items()}
    fed, per_sample = _fed(work / "train-feed.json", 1)
    where, per_job = {}, {}
    for name, jobs_ in runs.items():
        # what the service host's link sent in the case's jobs per sample trained: an upper
        # bound (also the final evaluation's held-out batch, the handshakes, and the batches
        # read ahead that the job stopped before)
        sent = [j["link_bytes"][2][0] for j in jobs_]
        per_job[name] = spread([b / (steps * global_batch) for b in sent])["median"]
        where[name] = {
            **_step_where(jobs_, unshaped[name]),
            # each host's link, [sent, received] per step (the first repeat, start-up and the
            # final evaluation included): the service host's, and the ranks' own collectives
            "link_mb_per_step_by_host": [
                [b / steps / 1e6 for b in tx_rx] for tx_rx in jobs_[0]["link_bytes"]
            ],
            "unshaped_samples_per_s": unshaped[name]["samples_per_s"],
            "link_bound_samples_per_s": link_bytes / per_sample[name],
            # the service host's upload carries both ranks' frames: its use of the link
            "link_use": spread(sps[name])["median"] * per_sample[name] / link_bytes,
            "wire_s_per_step_at_rate": per_sample[name] * global_batch / link_bytes,
        }
    ratio = _rate_ratio(runs, "ikjt", "kjt")
    figure = {
        **ratio,
        "target": 1.3,
        "met": ratio["median"] >= 1.3,
        "unshaped": unshaped["ikjt"]["samples_per_s"] / unshaped["kjt"]["samples_per_s"],
        "what": "2 ranks of `recpipe train --service` on 2 hosts trained by the reader service "
        "on a third over its shaped link (the ranks' own links unshaped unless "
        "`--service-rank-rate-mbit`): rank 0's steady samples/s with IKJT frames (`--dedup "
        "on` both ends) / with plain KJT frames (`--dedup off`: the model deduplicates); "
        "`unshaped`: the same with every link unshaped (once)",
    }
    return {
        "service_ikjt_vs_kjt_train_samples_per_s": figure,
        "service_train": {
            "hosts": 3,
            "ranks": 2,
            "rate_mbit": rate,
            "rates_mbit": rates,  # hosts 0, 1 (the ranks; None: unshaped), 2 (the service)
            "link_measured_mbit": link,  # host 2 to hosts 0 and 1
            "topology": topology,
            "cases": {n: " ".join(f) for n, f in SERVICE_TRAIN_CASES.items()},
            "common_flags": common,
            "repeats": args.service_repeats,
            "data": f"etl.synth, {args.service_requests} requests"
            if args.data is None
            else str(args.data),
            "seed": args.seed,
            "samples_per_s": {n: spread(v) for n, v in sps.items()},
            "unshaped_samples_per_s": {n: j["samples_per_s"] for n, j in unshaped.items()},
            "bytes_per_sample": per_sample,  # the frames, as the feed-only clients count them
            "link_bytes_per_trained_sample": per_job,
            "feed_only_samples_per_s": {n: v[0] for n, v in fed.items()},
            "where_the_time_goes": where,
            "steady_after_steps": WARM_STEPS,
        },
    }


def _hypereca_part(args: argparse.Namespace, dataset: Path, work: Path) -> dict[str, Any]:
    """2 hosts x 1 rank at ``--rate-mbit``: HypeReca's hot set shaped and unshaped, single
    collectives, and (``--service``) the reader service on 3 hosts."""
    from recpipe.testing.cluster import Cluster

    t0, load = time.perf_counter(), os.getloadavg()[0]
    with Cluster([args.rate_mbit, args.rate_mbit]) as cluster:
        nbytes = max(int(args.rate_mbit * 1e6 / 8), 1 << 20)  # about a second
        link = [cluster.transfer(0, 1, nbytes), cluster.transfer(1, 0, nbytes)]
        topology = cluster.describe()
        raw = _hypereca(cluster, dataset, args, work, name="shaped")
        calls = _collectives(cluster, work, name="calls-shaped")
        for host in (0, 1):  # the same job with the links unshaped: the link's share
            cluster.set_rate(host, None)
        unshaped = _hypereca(cluster, dataset, args, work, name="unshaped")
        calls_unshaped = _collectives(cluster, work, name="calls-unshaped")
    return {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("worker", "only", "service_steps", "service_repeats")
            and not k.startswith(("dmt_", "esd_"))
        },
        "topology": topology,
        "link_measured_mbit": [nbytes * 8 / s / 1e6 for s in link],
        **_summarise_hypereca(raw, args),
        **(_service(dataset, args, work) if args.service else {}),
        "unshaped": _unshaped(_summarise_hypereca(unshaped, args), raw, args),
        "collectives_ms": {
            "shaped": {k: v * 1e3 for k, v in calls.items()},
            "unshaped": {k: v * 1e3 for k, v in calls_unshaped.items()},
            # the bytes one way at the rate (what a full-duplex link would need)
            "at_rate": {
                f"all_to_all_{n}": n * 8 / (args.rate_mbit * 1e6) * 1e3
                for n in (64 << 10, 256 << 10, 1 << 20)
            },
        },
        "load_average_1m": [load, os.getloadavg()[0]],  # at the start, at the end
        "wall_s": time.perf_counter() - t0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the parts in ``args.only`` (a dict of results keys)."""
    from recpipe.testing.cluster import ClusterUnavailable, unavailable

    why = unavailable()
    if why is not None:
        raise ClusterUnavailable(f"no cluster in a box here: {why}")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="recpipe-bench-cluster-") as tmp:
            work = Path(tmp)
            dataset = args.data
            if dataset is None and {"hypereca", "esd"} & set(args.only):
                from benchmarks.distributed import build_dataset

                dataset = build_dataset(work, requests=args.requests, seed=args.seed)
            results: dict[str, Any] = {}
            if "hypereca" in args.only:
                results.update(_hypereca_part(args, dataset, work))
            for part in ("dmt", "esd", "service-train"):
                if part not in args.only:
                    continue
                t0, load = time.perf_counter(), os.getloadavg()[0]
                if part == "dmt":
                    figures = _dmt(args, work)
                elif part == "esd":
                    figures = _esd(args, dataset, work)
                else:
                    figures = _service_train(args, args.data, work)
                figures[part.replace("-", "_")].update(load_average_1m=[load, os.getloadavg()[0]],
                                                       wall_s=time.perf_counter() - t0)  # fmt: skip
                results.update(figures)
            return results
    finally:
        signal.signal(signal.SIGTERM, previous)


def merge_results(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``previous`` (a results file's contents, or None) with ``new``'s keys replacing its own,
    and ``not_measured`` naming the issue's figures neither holds."""
    derived = ("environment", "not_measured", "measured_elsewhere")
    merged = {k: v for k, v in (previous or {}).items() if k not in derived}
    merged.update(new)
    merged["measured_elsewhere"] = dict(ELSEWHERE)
    merged["not_measured"] = [n for n in FIGURE_PARTS if n not in merged and n not in ELSEWHERE]
    return merged


def _hypereca_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    h = results["hypereca"]
    rows = [
        ("link (Mbit/s each way)", f"{results['config']['rate_mbit']:g} shaped, measured "
         + " / ".join(f"{v:.1f}" for v in results["link_measured_mbit"])),
        ("samples/s by R", ", ".join(f"{r}: {v:,.0f}" for r, v in h["samples_per_s"].items())),
        ("chosen R / best measured", f"{h['chosen_r']} / {h['best_measured_r']} "
                                     f"(of {h['all_rows']:,} rows)"),
    ]  # fmt: skip
    f = results["hypereca_best_nonzero_r_vs_r0"]
    rows.append(("best R > 0 vs R = 0", f"{f['median']:.3f} (R={f['r']}; "
                 f"{f['wall']['min']:.3f}-{f['wall']['max']:.3f})"))  # fmt: skip
    u = results["unshaped"]
    rows.append(("unshaped, same job", "samples/s " + ", ".join(
        f"{r}: {v:,.0f}" for r, v in u["samples_per_s"].items())
        + f"; the link's share of the R=0 step {u['link_share_of_r0_step']:.0%}"))  # fmt: skip
    if "vs_torchrec_dmp_shaped" in results:
        f = results["vs_torchrec_dmp_shaped"]
        rows.append(("vs_torchrec_dmp_shaped", f"{_ratio_text(f)}; at the best R "
                     f"{f['best_r']['median']:.3f}, at R=0 {f['r0']['median']:.3f}"))  # fmt: skip
    for name in ("hypereca_best_r_vs_r0", "hypereca_chosen_vs_best"):
        f = results[name]
        rows.append((name, f"{f['median']:.3f} ({f['wall']['min']:.3f}-{f['wall']['max']:.3f}; "
                           f"target {f['target']}: {'met' if f['met'] else 'missed'})"))  # fmt: skip
    for r, w in h["where_the_time_goes"].items():
        rows.append((f"R={r} step", f"{w['step_s']['median'] * 1e3:.0f} ms, CPU rank 0 "
                     f"{w['rank0_cpu_s_per_step']['median'] * 1e3:.0f} ms / rank 1 "
                     f"{w['rank1_cpu_s_per_step']['median'] * 1e3:.0f} ms, on the wire "
                     f"{w['wire_s_at_rate'] * 1e3:.0f} ms + dense "
                     f"{w['dense_wire_s_at_rate'] * 1e3:.0f} ms (a2a "
                     f"{w['a2a_bytes_per_rank_step'] / 1e6:.2f} MB, hot all-reduce "
                     f"{w['allreduce_bytes_per_rank_step'] / 1e6:.2f} MB, dense all-reduce "
                     f"{w['dense_allreduce_bytes_per_rank_step'] / 1e6:.2f} MB per rank)"))  # fmt: skip
    c = results["collectives_ms"]
    for k in c["shaped"]:
        at = f", at the rate {c['at_rate'][k]:.1f}" if k in c["at_rate"] else ""
        rows.append((k, f"{c['shaped'][k]:.1f} ms shaped, {c['unshaped'][k]:.1f} ms unshaped{at}"))
    if "service" in results:
        f, sv = results["service_ikjt_vs_kjt_samples_per_s"], results["service"]
        rows.append(("service_ikjt_vs_kjt (feed)",
                     f"{f['median']:.3f} ({f['wall']['min']:.3f}-{f['wall']['max']:.3f}; target "
                     f"1.3: {'met' if f['met'] else 'missed'}); samples/s " + ", ".join(
                         f"{n}: {v['median']:,.0f} (link-bound {sv['link_bound_samples_per_s'][n]:,.0f},"
                         f" {sv['bytes_per_sample'][n]:.0f} B/sample, link use {sv['link_use'][n]:.0%})"
                         for n, v in sv["samples_per_s"].items())))  # fmt: skip
    return rows


def _ratio_text(f: dict[str, Any]) -> str:
    text = f"{f['median']:.3f} ({f['wall']['min']:.3f}-{f['wall']['max']:.3f})"
    if "target" in f:
        text += f"; target {f['target']}: {'met' if f['met'] else 'missed'}"
    return text


def _train_rows(results: dict[str, Any], part: str, figures: list[str]) -> list[tuple[str, str]]:
    p = results[part]
    rates = p.get("rates_mbit", p.get("rate_mbit"))
    rows = [(f"{part}: link (Mbit/s)", f"{rates} shaped, measured "
             + " / ".join(f"{v:.1f}" for v in p["link_measured_mbit"]))]  # fmt: skip
    rows += [(name, _ratio_text(results[name])) for name in figures]
    for name, w in p["where_the_time_goes"].items():
        rows.append((f"{part} {name}", f"{p['samples_per_s'][name]['median']:,.0f} samples/s, "
                     f"step {w['step_s']['median'] * 1e3:.0f} ms shaped / "
                     f"{w['unshaped_step_s'] * 1e3:.0f} ms unshaped "
                     f"(link {w['link_share_of_step']:.0%})"))  # fmt: skip
        if "link_s_per_step_by_host" in w:
            rows.append((f"{part} {name} on the wire", "each host's link needs " + ", ".join(
                f"{t * 1e3:.0f}" for t in w["link_s_per_step_by_host"])
                + " ms per step for the bytes it carried"))  # fmt: skip
    return rows


def _service_train_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    s = results["service_train"]
    rows = [("service-train: link (Mbit/s)", f"{s['rates_mbit']} shaped (None: unshaped), the "
             "service's measured " + " / ".join(f"{v:.1f}" for v in s["link_measured_mbit"])),
            ("service_ikjt_vs_kjt_train", _ratio_text(results[
                "service_ikjt_vs_kjt_train_samples_per_s"]))]  # fmt: skip
    for name, w in s["where_the_time_goes"].items():
        rows.append((f"service-train {name}", f"{s['samples_per_s'][name]['median']:,.0f} "
                     f"samples/s (feed only {s['feed_only_samples_per_s'][name]:,.0f}, the link "
                     f"allows {w['link_bound_samples_per_s']:,.0f} at "
                     f"{s['bytes_per_sample'][name]:.0f} B/sample), step "
                     f"{w['step_s']['median'] * 1e3:.0f} ms shaped / "
                     f"{w['unshaped_step_s'] * 1e3:.0f} ms unshaped, its frames need "
                     f"{w['wire_s_per_step_at_rate'] * 1e3:.0f} ms at the rate"))  # fmt: skip
    return rows


def _table(results: dict[str, Any]) -> str:
    rows = _hypereca_rows(results) if "hypereca" in results else []
    if "dmt" in results:
        rows += _train_rows(results, "dmt", ["dmt_sptt_tm_vs_flat", "dmt_sptt_vs_flat"])
        f = results["dmt_auc_delta"]
        rows.append(("dmt_auc_delta", f"{f['median']:+.4f} (by seed {f['by_seed']['values']}; "
                     f"target {f['target']}: {'met' if f['met'] else 'missed'})"))  # fmt: skip
    if "esd" in results:
        rows += _train_rows(results, "esd", ["esd_vs_laia_samples_per_s",
                                             "esd_vs_random_samples_per_s",
                                             "esd_alpha0_vs_laia_samples_per_s"])  # fmt: skip
    if "service_train" in results:
        rows += _service_train_rows(results)
    rows.append(("not measured", ", ".join(results["not_measured"]) or "-"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        options = json.loads(args.worker)
        kinds = {"hypereca": _hypereca_rank, "collectives": _collectives_rank,
                 "serve": _serve_rank, "feed": _feed_rank}  # fmt: skip
        kinds[options["kind"]](options)
        sys.stdout.flush()
        sys.stderr.flush()
        # gloo's threads can abort the interpreter's exit ("terminate called without an
        # active exception") after the group is gone: the rank's work is written, leave now
        os._exit(0)
    t0 = time.perf_counter()
    new = run(args)
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    results = merge_results(previous, new)
    path = write_results(results, args.out)
    print(f"benchmarks/cluster.py: measured {', '.join(args.only)} -> {path}")
    print(_table(results))
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
