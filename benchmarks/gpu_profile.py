"""Where a GPU training step spends its time: dedup on vs off, one profile of each.

Trains the benchmark's DLRM (``benchmarks/trainer.py``'s model and dataset) a few untimed steps,
then profiles ``--steps`` steps of each mode with ``torch.profiler`` (host and device) and runs one
more step of each with torch's sync debug mode on, which names every place that makes the host
wait for the device. Writes a JSON summary (``--out``) and prints:

* per mode: the host's time per step (its operators' own time, waits at syncs included) and the
  device's (its kernels, copies and memsets), the number of host-device syncs
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``) and of
  ``cudaMemcpyAsync`` calls per step, and the top kernels by device time;
* the source lines (recpipe's and the trainer's own frames) where the syncs happen.

Needs a CUDA device (``--device cpu`` only checks the script). Run: ``python -m benchmarks.gpu_profile --data DATA [--batch-size 32768]
[--steps 3] [--out profile.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _profile_mode(trainer: Any, batches: list[Any], steps: int) -> dict[str, Any]:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for batch in batches[:steps]:
            trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize(trainer.device)
    averages = prof.key_averages()
    syncs = sum(e.count for e in averages if e.key in _SYNC_EVENTS)
    memcpys = sum(e.count for e in averages if e.key == "cudaMemcpyAsync")
    # the device's own events (kernels, copies, memsets): an operator's row repeats its
    # kernels' time, so only these add up to the device's time
    on_device = [e for e in averages if e.device_type == DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in on_device)
    host_us = sum(e.self_cpu_time_total for e in averages if e.device_type == DeviceType.CPU)
    top = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "host_ms_per_step": host_us / 1e3 / steps,
        "device_ms_per_step": device_us / 1e3 / steps,
        "syncs_per_step": syncs / steps,
        "memcpy_calls_per_step": memcpys / steps,
        "top_device_ops": [
            {
                "op": e.key,
                "device_ms_per_step": e.self_device_time_total / 1e3 / steps,
                "calls_per_step": e.count / steps,
            }
            for e in top[:20]
        ],
    }


def _sync_sites(trainer: Any, batch: Any) -> dict[str, int]:
    """``file:line`` of this repository's innermost frame at every sync torch reports in one
    training step (torch's sync debug mode warns at each)."""
    import torch

    root = str(Path(__file__).resolve().parent.parent)
    sites: collections.Counter[str] = collections.Counter()

    def record(*_args: Any, **_kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        last = frames[-1] if frames else None
        where = f"{Path(last.filename).relative_to(root)}:{last.lineno}" if last else "?"
        sites[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored when the block ends
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(batch)
            torch.cuda.synchronize(trainer.device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites.most_common())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a clustered dataset")
    parser.add_argument("--batch-size", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per mode")
    parser.add_argument("--out", type=Path, default=Path("profile.json"))
    parser.add_argument(
        "--device", default="cuda", help="cuda (default); cpu only checks this script: no syncs"
    )
    args = parser.parse_args(argv)

    import torch

    from benchmarks.trainer import load_batches
    from benchmarks.trainer import parse_args as trainer_args
    from readers.dataset import dataset_schema
    from trainer.models import DLRM, ModelConfig
    from trainer.train import Trainer

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_profile needs a CUDA device (torch sees none)")
    torch.set_num_threads(1)
    schema = dataset_schema(args.data)
    count = args.steps + 3
    bench = trainer_args(["--data", str(args.data)])  # benchmarks.trainer's model, --dense-grads
    config = ModelConfig(embedding_dim=bench.embedding_dim, num_embeddings=bench.num_embeddings,
                         seed=bench.seed, sparse_grad=False)  # fmt: skip
    out: dict[str, Any] = {"batch_size": args.batch_size, "steps": args.steps}
    for mode in ("on", "off"):
        batches = [
            b.to(device)
            for b in load_batches(args.data, batch_size=args.batch_size, count=count,
                                  dedup=mode == "on")
        ]  # fmt: skip
        model = DLRM.from_schema(schema, config)
        if mode == "off":
            model.set_dedup_groups(())
        trainer = Trainer(model, device=device)
        for batch in batches[:2]:  # warm-up: compilation, the caching allocator
            trainer.train_step(batch)
        summary = _profile_mode(trainer, batches[2:], args.steps)
        summary["sync_sites"] = _sync_sites(trainer, batches[-1]) if device.type == "cuda" else {}
        out[mode] = summary
        print(f"dedup {mode}: host {summary['host_ms_per_step']:.1f} ms/step, device "
              f"{summary['device_ms_per_step']:.1f} ms/step, {summary['syncs_per_step']:.0f} "
              f"syncs/step", file=sys.stderr)  # fmt: skip
        for row in summary["top_device_ops"][:12]:
            print(f"    {row['device_ms_per_step']:8.3f} ms x{row['calls_per_step']:5.0f}  "
                  f"{row['op'][:90]}", file=sys.stderr)  # fmt: skip
        for site, n in list(summary["sync_sites"].items())[:15]:
            print(f"    sync x{n}: {site}", file=sys.stderr)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
