"""scripts/sim_autoscale.py: the scaler model behaves like KEDA as infra/k8s configures it (short runs)."""
from __future__ import annotations

import numpy as np
import sim_autoscale as sim


def test_service_times_come_from_the_engine_benchmark() -> None:
    times = sim.service_times(speedup=1.0)  # exits if the rebuilt workload no longer matches bench-results
    assert 0 < times["xs"] < times["s"] < times["m"]
    assert sim.service_times(speedup=10.0)["xs"] * 10 == times["xs"]


def test_lists_only_scaler_drops_to_zero_while_jobs_are_held() -> None:
    lists, held = sim.Scaler("lists", target=16), sim.Scaler("lists+inflight", target=16)
    assert lists.desired(0, waiting=40, held=0, current=0) == 3 == held.desired(0, waiting=40, held=0, current=0)
    # the lists are empty but 10 jobs are running: past the cooldown only the held count keeps a worker
    assert lists.desired(sim.COOLDOWN_S + 15, waiting=0, held=10, current=3) == 0
    assert held.desired(sim.COOLDOWN_S + 15, waiting=0, held=10, current=3) == 2  # one pod a minute
    assert held.desired(sim.COOLDOWN_S + 30, waiting=0, held=10, current=2) == 2
    # scale-up is immediate; scale-down keeps the highest recommendation of the last WINDOW_S seconds
    assert held.desired(sim.COOLDOWN_S + 45, waiting=40, held=0, current=2) == 3
    assert held.desired(sim.COOLDOWN_S + 200, waiting=0, held=10, current=3) == 3


def test_scale_from_zero_pays_the_cold_start_and_finishes_every_job() -> None:
    arrivals = np.sort(np.random.default_rng(0).uniform(0, 100, 200))
    auto = sim.simulate(arrivals, service=0.5, slots=8, scaler=sim.Scaler("lists+inflight", 16), cold_start=30)
    fixed = sim.simulate(arrivals, service=0.5, slots=8, scaler=sim.Scaler("fixed", 16, fixed=2), cold_start=30)
    assert auto["jobs"] == fixed["jobs"] == 200
    assert auto["wait_p95_s"] >= 20 > fixed["wait_p95_s"]
