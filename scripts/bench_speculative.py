"""Speculative decoding on the bundled model: acceptance, tokens per target forward, and wall-clock throughput
relative to the same engine without speculation, per proposer and batch size, in one process run.

    python scripts/bench_speculative.py [--quick] [--json bench-results/speculative.json]
    python scripts/bench_speculative.py --sampled 40     # seeded against unseeded sampling (docs/worker.md)

Workloads (held-out splits of the bundled model, see its README): "captions" (seed 22, "Describe the image.",
the long answers where decode dominates) and "mixed" (seed 7: 40% captions, the rest short questions). Batch b
runs the requests in waves of b submitted at once (batch 1: one request at a time; 32 requests at batch 1, 96 at
batch 8 and 32). Greedy, eos on; every proposer's tokens are checked equal to the plain engine's. Each round runs
every engine once, in an order that rotates from round to round, so load from other processes hits all alike;
`speedup` / `speedup_wall` compare the best round of each engine (least CPU time, least wall-clock time), the
`_median` fields the median rounds.

`adaptive` rows use the engine's default SpecConfig (adaptive k, off above max_batch decodes); `forced` rows set
max_batch above the batch (adaptive k still picks k), which measures where proposing stops paying: the default
thresholds (spec_decode.MAX_BATCH) come from there.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tiny.shapes import make_split

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.proposers import HEAD_DIR
from vlmq.workers.engine.spec_decode import MAX_BATCH, SpecConfig, SpecStats

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "workers" / "assets" / "tiny-shapes"
DRAFT = ROOT / "workers" / "assets" / "tiny-shapes-draft"
MAX_NEW = 64


NUM_BATCH1 = 32  # requests at batch 1 (one at a time)


def workloads(quick: bool) -> dict[str, list[Request]]:
    n = 32 if quick else 96
    captions = make_split(22, n, caption_prob=1.0)
    mixed = make_split(7, n)
    return {"captions": [Request(e.image, e.question, MAX_NEW) for e in captions],
            "mixed": [Request(e.image, e.question, MAX_NEW) for e in mixed]}


def run(engine: Engine, requests: list[Request], batch: int) -> tuple[float, float, list[list[int]], SpecStats]:
    """-> (wall seconds, CPU seconds of this process, tokens, stats)."""
    engine.stats.speculative = SpecStats(engine.stats.speculative.proposer)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = []
    for i in range(0, len(requests), batch):
        outs += engine.generate(requests[i:i + batch], prepare_all_first=True)
    return time.perf_counter() - t0, time.process_time() - c0, [o.token_ids for o in outs], engine.stats.speculative


def methods() -> list[str]:
    found = ["ngram", f"draft:{DRAFT}"]
    return found + (["head"] if (MODEL / HEAD_DIR).is_dir() else [])


def bench(quick: bool, rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    engines = {None: Engine.from_model_dir(MODEL, num_blocks=4096)}
    for m in methods():
        engines[(m, "adaptive")] = Engine.from_model_dir(MODEL, num_blocks=4096, speculative=m)
        engines[(m, "forced")] = Engine.from_model_dir(MODEL, num_blocks=4096,
                                                       speculative=SpecConfig(m, max_batch=10_000))
    rows = []
    for name, requests in workloads(quick).items():
        for engine in engines.values():  # warm-up: an engine's first wave of 32 takes about twice as long
            run(engine, requests[:32], 32)
        for batch in (1, 8, 32):
            reqs = requests[:NUM_BATCH1] if batch == 1 else requests
            # forced equals adaptive at batch 1 (below max_batch)
            keys = [k for k in engines if batch > 1 or k is None or k[1] != "forced"]
            results: dict = {k: [] for k in keys}
            for r in range(rounds):
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    results[key].append(run(engines[key], reqs, batch))
            rows += report(name, batch, results)
    for engine in engines.values():
        engine.close()
    return rows


def bench_sampled(n: int, rounds: int) -> list[dict]:
    """Sampled captions (temperature 1.0) at batch 1, the head proposer against the plain engine, seeded (request i:
    seed i; verified by matching, spec_decode.verify_seeded) and unseeded (rejection sampling), interleaved rounds:
    acceptance, tokens per target forward, speed-up in tokens per second; seeded answers must equal the plain
    engine's."""
    torch.set_num_threads(1)
    captions = make_split(22, n, caption_prob=1.0)
    plain = Engine.from_model_dir(MODEL, num_blocks=4096)
    head = Engine.from_model_dir(MODEL, num_blocks=4096, speculative="head")
    rows = []
    for mode in ("seeded", "unseeded"):
        reqs = [Request(e.image, e.question, MAX_NEW, temperature=1.0, seed=i if mode == "seeded" else None)
                for i, e in enumerate(captions)]
        engines = {None: plain, ("head", mode): head}
        for engine in engines.values():
            run(engine, reqs[:4], 1)  # warm-up
        results: dict = {k: [] for k in engines}
        for r in range(rounds):
            for key in list(engines)[r % 2:] + list(engines)[:r % 2]:
                results[key].append(run(engines[key], reqs, 1))
        rows += report(f"captions-t1-{mode}", 1, results)
    plain.close()
    head.close()
    return rows


def summary(results: list[tuple]) -> dict:
    """Best and median round of one engine: wall and CPU seconds; the tokens and stats of its least-CPU round."""
    walls, cpus = sorted(r[0] for r in results), sorted(r[1] for r in results)
    best = min(results, key=lambda r: r[1])
    tokens_same = all(r[2] == best[2] for r in results)
    return dict(wall=walls[0], cpu=cpus[0], wall_median=walls[len(walls) // 2], cpu_median=cpus[len(cpus) // 2],
                tokens=best[2], same_each_round=tokens_same, stats=best[3])


def report(workload: str, batch: int, results: dict) -> list[dict]:
    base = summary(results[None])
    num_tokens = sum(map(len, base["tokens"]))
    rows = [dict(workload=workload, batch=batch, proposer="none", mode="-", requests=len(base["tokens"]),
                 tokens=num_tokens, wall_s=round(base["wall"], 3), cpu_s=round(base["cpu"], 3),
                 tokens_per_s=round(num_tokens / base["cpu"], 1), speedup=1.0, speedup_wall=1.0)]
    for (method, mode), runs in ((k, v) for k, v in results.items() if k is not None):
        got = summary(runs)
        st = got["stats"]
        own = sum(map(len, got["tokens"]))  # sampled without a seed: another count than the plain engine's
        f = own / num_tokens  # speed-ups compare tokens per second
        rows.append(dict(
            workload=workload, batch=batch, proposer=method.split(":")[0], mode=mode, requests=len(base["tokens"]),
            tokens=own, wall_s=round(got["wall"], 3), cpu_s=round(got["cpu"], 3),
            tokens_per_s=round(own / got["cpu"], 1), speedup=round(f * base["cpu"] / got["cpu"], 3),
            speedup_wall=round(f * base["wall"] / got["wall"], 3),
            speedup_median=round(f * base["cpu_median"] / got["cpu_median"], 3),
            speedup_wall_median=round(f * base["wall_median"] / got["wall_median"], 3),
            acceptance=round(st.acceptance_rate, 3), tokens_per_forward=round(st.tokens_per_forward, 3),
            proposed=st.num_proposed, accepted=st.num_accepted,
            same_tokens=got["same_each_round"] and got["tokens"] == base["tokens"]))
    for r in rows:
        print(json.dumps(r))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 requests a workload, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sampled", type=int, metavar="N",
                        help="instead: N sampled captions at batch 1, head, seeded and unseeded (bench_sampled)")
    parser.add_argument("--json", default=None, help="default bench-results/speculative[-sampled].json")
    args = parser.parse_args()
    args.json = args.json or str(ROOT / "bench-results" / f"speculative{'-sampled' if args.sampled else ''}.json")
    t0 = time.perf_counter()
    rounds = 1 if args.quick else args.rounds
    rows = bench_sampled(args.sampled, rounds) if args.sampled else bench(args.quick, rounds)
    meta = dict(model=MODEL.name, max_new_tokens=MAX_NEW, torch_threads=1, wall_s=round(time.perf_counter() - t0),
                rounds=rounds,
                default=dict(max_k=SpecConfig("ngram").max_k, max_batch=MAX_BATCH))
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {args.json} in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
