"""Queue-length autoscaling (KEDA as infra/k8s configures it) replayed on an arrival trace, against a fixed fleet.

    python scripts/sim_autoscale.py [--hours 24] [--trace arrivals.csv] [--json bench-results/sim_autoscale.json]

Per cost class, one Deployment of workers (as scripts/gen_k8s.py writes them). Each worker holds up to
min(VLMQ_WORKER_BATCH, VLMQ_WORKER_BUDGET // class cost) jobs and shares its throughput among them (one
worker-second of work per second). Service times come from bench-results/engine-rand30m.json (the 30 M
Qwen2-VL, mixed captions, all 48 requests batched together): the encoder's seconds per vision token and the
forward pass's seconds per generated token, times each class's mean vision tokens and the mean answer
length of that workload (rebuilt here from the benchmark's seed; the script checks it regenerates the same
token count). They are CPU seconds: read "worker-hours", or scale with --speedup for a GPU.

Scalers, polled every 15 s like KEDA:
  lists            desired = ceil(waiting / target): the Redis lists only (the committed ScaledObjects)
  lists+inflight   desired = ceil((waiting + held) / target): adds the jobs workers hold (vlmq_queue_unacked)
both with KEDA's activation (scale from zero on the first waiting job), cooldownPeriod before zero, the HPA
scale-down window (the highest recommendation of the last 300 s, one pod a minute at most), a cold start
before a new worker takes work, and a graceful stop (a removed worker finishes what it holds). Fixed fleet:
ceil(peak load / 0.8).

The generated trace: 24 h of Poisson arrivals per class with a daily curve (peak at 14:00, night at 10 %
of it) and one bulk submit of 3,000 xs jobs over a minute at 09:00. --trace replays a CSV of
``seconds,class`` rows instead.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import gen_k8s  # scripts/: the ScaledObjects' settings
import numpy as np

from vlmq.cost import ResolutionPolicy, estimate
from vlmq.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench-results" / "engine-rand30m.json"
# the benchmark's 30 M model: Qwen2-VL's 14-px patches with the bundled processor's pixel bounds
POLICY = ResolutionPolicy(patch_size=14, merge_size=2, min_pixels=224 * 224, max_pixels=1024 * 1024)
PEAK_RATE = {"xs": 4.0, "s": 1.5, "m": 0.5}  # jobs/s at the daily peak
# the ScaledObjects' settings, from the script that writes them
POLL_S, COOLDOWN_S, WINDOW_S = gen_k8s.POLLING_S, gen_k8s.COOLDOWN_S, gen_k8s.SCALE_DOWN_WINDOW_S
DOWN_PERIOD_S, MAX_REPLICAS = gen_k8s.SCALE_DOWN_PERIOD_S, gen_k8s.MAX_REPLICAS


def benchmark_requests(n: int = 48, max_side: int = 1344, lengths: tuple[int, int] = (16, 256)) -> list[tuple]:
    """(class, vision tokens, answer tokens) of bench_engine.py's mixed captions (its seed and draw order)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        long = int(np.exp(rng.uniform(np.log(64), np.log(max_side))))
        short = max(56, long * 3 // 4)
        size = (long, short) if rng.random() < 0.5 else (short, long)
        answer = int(rng.integers(*lengths, endpoint=True))
        cost = estimate(size[0], size[1], POLICY)
        out.append((cost.cost_class, cost.vision_tokens, answer))
    return out


def service_times(speedup: float) -> dict[str, float]:
    """Worker-seconds one job of each class takes, from the engine benchmark's time split."""
    engine = json.loads(BENCH.read_text())["models"]["rand30m"]["mixed_captions"]["engine"]
    requests = benchmark_requests()
    if sum(r[2] for r in requests) != engine["generated_tokens"]:
        raise SystemExit("the rebuilt benchmark workload does not match bench-results (bench_engine.py changed?)")
    per_vision_token = engine["time_split_s"]["runner_encode"] / sum(r[1] for r in requests)
    per_answer_token = engine["time_split_s"]["runner_forward"] / engine["generated_tokens"]
    mean_answer = engine["generated_tokens"] / len(requests)
    times = {}
    for cost_class in PEAK_RATE:
        tokens = [r[1] for r in requests if r[0] == cost_class]
        times[cost_class] = (per_vision_token * float(np.mean(tokens)) + per_answer_token * mean_answer) / speedup
    return times


def generated_trace(hours: float, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    horizon = int(hours * 3600)
    t = np.arange(horizon)
    curve = 0.1 + 0.9 * (0.5 + 0.5 * np.cos(2 * np.pi * (t / 3600 - 14) / 24))  # 1.0 at 14:00, 0.1 at 02:00
    trace = {}
    for cost_class, peak in PEAK_RATE.items():
        counts = rng.poisson(peak * curve)
        arrivals = np.repeat(t, counts) + rng.random(counts.sum())
        if cost_class == "xs" and horizon > 9 * 3600 + 60:
            arrivals = np.concatenate([arrivals, 9 * 3600 + 60 * rng.random(3000)])
        trace[cost_class] = np.sort(arrivals)
    return trace


def read_trace(path: Path) -> dict[str, np.ndarray]:
    rows: dict[str, list[float]] = {}
    with path.open() as f:
        for seconds, cost_class in csv.reader(f):
            rows.setdefault(cost_class, []).append(float(seconds))
    return {c: np.sort(np.array(v)) for c, v in rows.items()}


@dataclass
class Worker:
    ready_at: float  # cold start: takes work from this time on
    jobs: list = field(default_factory=list)  # [remaining work s, arrival s, start s]
    draining: bool = False


@dataclass
class Scaler:
    policy: str  # "fixed", "lists" or "lists+inflight"
    target: int  # waiting jobs per replica
    fixed: int = 0
    history: list = field(default_factory=list)  # (time, desired)
    idle_since: float = 0.0
    last_down: float = -math.inf

    def desired(self, now: float, waiting: int, held: int, current: int) -> int:
        if self.policy == "fixed":
            return self.fixed
        metric = waiting + (held if self.policy == "lists+inflight" else 0)
        if metric == 0:  # inactive: zero only after the cooldown, until then the HPA keeps at least one
            if now - self.idle_since >= COOLDOWN_S:
                return 0
            want = min(current, 1)
        else:
            self.idle_since = now
            want = max(1, min(MAX_REPLICAS, math.ceil(metric / self.target)))
        self.history = [(t, d) for t, d in self.history if now - t < WINDOW_S] + [(now, want)]
        if want >= current:
            return want
        # scale down: to the highest recommendation in the window, one pod per DOWN_PERIOD_S at most
        if now - self.last_down < DOWN_PERIOD_S:
            return current
        self.last_down = now
        return max(max(d for _, d in self.history), current - 1)


def simulate(arrivals: np.ndarray, service: float, slots: int, scaler: Scaler, cold_start: float,
             dt: float = 0.25) -> dict[str, float]:
    workers = [Worker(0.0) for _ in range(scaler.fixed)]
    queue: list[float] = []
    waits, latencies = [], []
    next_arrival, busy_s, now, next_poll = 0, 0.0, 0.0, 0.0
    end = (arrivals[-1] if len(arrivals) else 0.0) + 1.0
    while now < end or queue or any(w.jobs for w in workers):
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= now:
            queue.append(float(arrivals[next_arrival]))
            next_arrival += 1
        if scaler.policy != "fixed" and now >= next_poll:
            _rescale(workers, scaler, now, len(queue), cold_start)
            next_poll += POLL_S
        for w in workers:
            while not w.draining and w.ready_at <= now and queue and len(w.jobs) < slots:
                arrival = queue.pop(0)
                waits.append(now - arrival)
                w.jobs.append([service, arrival, now])
            if w.jobs:  # processor sharing: one worker-second of work per second among the held jobs
                share = dt / len(w.jobs)
                for job in w.jobs:
                    job[0] -= share
                latencies += [now + dt - j[1] for j in w.jobs if j[0] <= 0]
                w.jobs = [j for j in w.jobs if j[0] > 0]
        workers = [w for w in workers if not (w.draining and not w.jobs)]
        busy_s += len(workers) * dt
        now += dt
    return {"jobs": len(latencies), "wait_p50_s": _pct(waits, 50), "wait_p95_s": _pct(waits, 95),
            "wait_p99_s": _pct(waits, 99),
            "latency_p95_s": _pct(latencies, 95), "worker_hours": busy_s / 3600}


def _rescale(workers: list[Worker], scaler: Scaler, now: float, waiting: int, cold_start: float) -> None:
    live = [w for w in workers if not w.draining]
    want = scaler.desired(now, waiting, sum(len(w.jobs) for w in live), len(live))
    for _ in range(want - len(live)):
        workers.append(Worker(now + cold_start))
    for w in sorted(live, key=lambda w: len(w.jobs))[:max(0, len(live) - want)]:
        w.draining = True  # SIGTERM: stop taking work, finish what it holds


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run(trace: dict[str, np.ndarray], speedup: float, cold_start: float) -> dict[str, dict[str, dict]]:
    settings = Settings()
    times = service_times(speedup)
    report: dict[str, dict[str, dict]] = {}
    for cost_class, arrivals in trace.items():
        bound = {"xs": 256, "s": 1024, "m": 4096}[cost_class]
        slots = min(settings.worker_batch, settings.worker_budget // (bound + settings.text_token_bound))
        fixed = math.ceil(PEAK_RATE[cost_class] * times[cost_class] / 0.8)
        rows = {}
        for policy in ("fixed", "lists", "lists+inflight"):
            scaler = Scaler(policy, settings.worker_batch, fixed=fixed if policy == "fixed" else 0)
            rows[policy] = {**simulate(arrivals, times[cost_class], slots, scaler, cold_start),
                            "service_s": times[cost_class], "slots": slots}
        rows["fixed"]["workers"] = fixed
        report[cost_class] = rows
    return report


def print_table(report: dict[str, dict[str, dict]]) -> None:
    print("| class | service s/job | fleet | jobs | wait p50 s | wait p95 s | wait p99 s | latency p95 s | "
          "worker-hours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cost_class, rows in report.items():
        for policy, r in rows.items():
            fleet = f"fixed {r['workers']}" if policy == "fixed" else f"KEDA {policy}"
            waits = " | ".join(f"{r[k]:.1f}" for k in ("wait_p50_s", "wait_p95_s", "wait_p99_s", "latency_p95_s"))
            print(f"| {cost_class} | {r['service_s']:.2f} | {fleet} | {r['jobs']:,} | {waits} | "
                  f"{r['worker_hours']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--trace", type=Path, help="CSV of seconds,class arrivals (default: the generated trace)")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide the measured service times by this")
    ap.add_argument("--cold-start", type=float, default=60.0, help="seconds before a new worker takes work")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args()
    trace = read_trace(args.trace) if args.trace else generated_trace(args.hours)
    report = run(trace, args.speedup, args.cold_start)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
