"""What SGLang's /update_weights_from_disk costs through the mesh: the time from the call to its
answer, with every worker reading a later checkpoint of the served model in place, against reading
the same checkpoint with safetensors into tensors of its shapes in this process, in the same run
(what any in-place load must do).

    .venv/bin/python bench/weight_update.py [--model 160m|7m] [--prefill 1] [--decode 1] [--rounds 3]

Two checkpoints of one shape (the demo model's, two seeds) are made in a temporary directory; `baton
up` serves the first; each round updates to the other and back (no request running, so no drain),
timed by the client, and copies one checkpoint's tensors (`safetensors.torch.load_file`, which maps
the file) into tensors allocated beforehand. update_s is the median call, worker_read_s the median
of what the workers report reading, safetensors_read_s the median plain copy;
update_vs_safetensors_read is the first over the last. A greedy completion before
and after the first update must differ (the weights did change). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.engine_throughput import MODELS  # noqa: E402
from bench.local_mesh import LocalMesh, log  # noqa: E402
from engine.demo_model import make_demo_model  # noqa: E402


def greedy(client: httpx.Client, mesh: LocalMesh) -> str:
    answer = client.post(f"http://{mesh.http}/v1/completions", json={
        "model": mesh.model_name, "prompt": "The weights are", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"]


def update(client: httpx.Client, mesh: LocalMesh, model_dir: Path) -> tuple[float, list[float]]:
    """Seconds the call took, and each worker's reported read."""
    start = time.perf_counter()
    answer = client.post(f"http://{mesh.http}/update_weights_from_disk", json={"model_path": str(model_dir)})
    seconds = time.perf_counter() - start
    body = answer.json()
    if answer.status_code != 200 or not body["success"]:
        raise RuntimeError(f"the update failed: {answer.text}")
    return seconds, [float(s) for s in re.findall(r"updated in ([0-9.]+) s", body["message"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="160m", choices=sorted(MODELS))
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first, second = (make_demo_model(Path(tmp) / f"seed{seed}", seed=seed, **MODELS[args.model]) for seed in (1, 2))
        checkpoint_bytes = sum(f.stat().st_size for f in second.glob("*.safetensors"))
        log(f"two {args.model} checkpoints of {checkpoint_bytes / 1e6:.0f} MB each")
        mesh = LocalMesh(first, "--prefill", str(args.prefill), "--decode", str(args.decode))
        try:
            with httpx.Client(timeout=600) as client:
                before = greedy(client, mesh)
                calls, reads, plain = [], [], []
                targets = {name: torch.empty_like(t) for name, t in load_file(second / "model.safetensors").items()}
                for round_ in range(args.rounds):
                    for target in (second, first):
                        seconds, worker_reads = update(client, mesh, target)
                        if round_ == 0 and target == second and greedy(client, mesh) == before:
                            raise RuntimeError("the completion did not change with the weights")
                        calls.append(seconds)
                        reads += worker_reads
                        log(f"round {round_}: updated to {target.name} in {seconds:.2f} s (workers read "
                            f"{', '.join(f'{s:.2f}' for s in worker_reads)} s)")
                    start = time.perf_counter()
                    for name, tensor in load_file(second / "model.safetensors").items():
                        targets[name].copy_(tensor)
                    plain.append(time.perf_counter() - start)
                    log(f"round {round_}: safetensors read the checkpoint in {plain[-1]:.2f} s")
        finally:
            mesh.stop()
    update_s, read_s, plain_s = statistics.median(calls), statistics.median(reads), statistics.median(plain)
    log(f"update_weights_from_disk: {update_s:.2f} s through the mesh ({args.prefill} prefill, {args.decode} decode), "
        f"the workers reading {read_s:.2f} s; safetensors alone {plain_s:.2f} s: {update_s / plain_s:.2f}x")
    print(json.dumps({"update_s": round(update_s, 3), "worker_read_s": round(read_s, 3),
                      "safetensors_read_s": round(plain_s, 3),
                      "update_vs_safetensors_read": round(update_s / plain_s, 2), "model": args.model,
                      "checkpoint_bytes": checkpoint_bytes, "prefill": args.prefill, "decode": args.decode}),
          flush=True)


if __name__ == "__main__":
    main()
