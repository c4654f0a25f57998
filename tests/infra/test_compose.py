"""infra/compose, infra/docker, Prometheus and Grafana offline: the compose schema, and names checked against vlmq."""
from __future__ import annotations

import importlib.metadata
import json
import re

import gen_k8s
import jsonschema
import pytest
import yaml
from manifests import INFRA, ROOT, SCHEMAS

from vlmq.settings import ENV_VARS, Settings, env_name

COMPOSE = INFRA / "compose" / "compose.yaml"
AWS = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services_env(compose: dict) -> dict[str, dict[str, str]]:
    return {name: s.get("environment", {}) for name, s in compose["services"].items()}


def test_compose_matches_the_compose_spec(compose: dict) -> None:
    # the spec says draft-07 (spelt without the trailing '#' jsonschema looks for)
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)
    bad = json.loads(json.dumps(compose))
    bad["services"]["worker"]["stop_grace"] = "10s"
    with pytest.raises(jsonschema.ValidationError, match="stop_grace"):
        jsonschema.Draft7Validator(schema).validate(bad)


def test_every_variable_has_a_default() -> None:
    # `docker compose up` without an .env file must not interpolate an empty credential
    for ref in re.findall(r"(?<!\$)\$\{([^}]*)\}", COMPOSE.read_text()):
        assert ":-" in ref, ref


def test_gpu_and_cpu_profiles_run_the_same_stack(compose: dict) -> None:
    services = compose["services"]
    gpu, cpu = services["worker"], services["worker-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["command"] == ["worker", "--gpus", "all"] and cpu["command"] == ["worker", "--device", "cpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in cpu
    shared = {n for n, s in services.items() if "profiles" not in s}
    assert {"valkey", "minio", "bucket", "delivery", "serve", "flower", "prometheus", "grafana"} == shared
    assert services["delivery"]["command"] == ["delivery"]
    assert services["serve"]["command"][0] == "serve" and services["serve"]["ports"] == ["8000:8000"]
    for slim in ("delivery", "serve"):
        assert "worker" not in services[slim]["build"]["dockerfile"]  # the slim image, no torch
    for worker in (gpu, cpu):
        grace = int(worker["environment"]["VLMQ_SHUTDOWN_GRACE"])
        assert grace >= Settings().shutdown_grace
        assert int(worker["stop_grace_period"].rstrip("s")) > grace


def test_env_names_are_settings(compose: dict) -> None:
    names = {k for env in services_env(compose).values() for k in env if k.startswith(("VLMQ_", "AWS_"))}
    assert names - set(ENV_VARS) - AWS == set()
    for name in ("worker", "worker-cpu", "delivery"):
        env = services_env(compose)[name]
        assert {"VLMQ_BROKER_URL", "VLMQ_STORAGE_URL", "AWS_ENDPOINT_URL"} <= set(env)
        Settings.from_env(env)  # every value parses


def test_urls_point_at_the_services(compose: dict) -> None:
    env = services_env(compose)["worker"]
    services = compose["services"]
    password = "${VALKEY_PASSWORD:-vlmq-change-me}"
    assert env["VLMQ_BROKER_URL"] == f"redis://:{password}@valkey:6379/0" and "6379:6379" in services["valkey"]["ports"]
    assert services["valkey"]["command"][-2:] == ["--requirepass", password]  # never an open Redis on the node
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000" and "9000:9000" in services["minio"]["ports"]
    bucket = env["VLMQ_STORAGE_URL"].removeprefix("s3://").split("/")[0]
    assert f"local/{bucket}" in services["bucket"]["command"][0]
    assert f"--broker={env['VLMQ_BROKER_URL']}" in services["flower"]["command"]
    assert env["VLMQ_WORKER_EVENTS"] == "1"  # Flower sees nothing without task events


def test_prometheus_scrapes_every_worker_metrics_port(compose: dict) -> None:
    port = gen_k8s.METRICS_PORT
    assert int(services_env(compose)["worker"][env_name("metrics_port")]) == port
    config = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    # --gpus all: child k serves on VLMQ_METRICS_PORT + k (up to 8 GPUs a node)
    assert {f"worker:{port + k}" for k in range(8)} | {f"worker-cpu:{port}"} == targets
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def dockerfile(name: str) -> str:
    return (INFRA / "docker" / f"{name}.Dockerfile").read_text()


def test_worker_image_is_cuda_torch_then_vlmq_worker_gpu() -> None:
    text = dockerfile("worker")
    assert re.search(r"^ARG BUILD_IMAGE=nvidia/cuda:\S+-devel-", text, re.M)
    assert re.search(r"^ARG RUNTIME_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    assert re.search(r"pip install .*--index-url \$\{TORCH_INDEX\} torch==", text)
    assert re.search(r"^ARG EXTRAS=worker,gpu$", text, re.M)
    assert {"worker", "gpu"} <= set(importlib.metadata.metadata("vlmq").get_all("Provides-Extra"))
    assert f"EXPOSE {gen_k8s.METRICS_PORT}" in text and f"VLMQ_METRICS_PORT={gen_k8s.METRICS_PORT}" in text
    assert 'ENTRYPOINT ["tini", "--", "vlmq"]' in text  # the k8s preStop signals PID 1 (tini)


def test_producer_image_has_no_torch() -> None:
    code = [line for line in dockerfile("producer").splitlines() if not line.startswith("#")]
    installs = [line.split("pip install")[-1] for line in code if "pip install" in line]
    assert not any("torch" in line or ("[" in line and "[serve]" not in line) for line in installs)
    assert 'RUN pip install --no-cache-dir ".[serve]" && rm -rf /src' in code  # the serve extra: no torch either


@pytest.mark.parametrize("name", ["worker", "producer"])
def test_images_copy_what_exists_and_dockerignore_keeps_it(name: str) -> None:
    ignore = (INFRA / "docker" / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    for line in dockerfile(name).splitlines():
        if line.startswith("COPY") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore, source


def metric_names(expr: str) -> set[str]:
    """Series names used in a PromQL expression (label matchers, ranges, grouping and functions removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr))
    return names - PROMQL_WORDS


def exported_series() -> set[str]:
    series = set()
    for line in (INFRA / "metrics.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, kind = line.split("\t")[:2]
            assert name.startswith("vlmq_"), name
            series |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    return series


def test_dashboard_uses_only_exported_series() -> None:
    dashboard = json.loads((INFRA / "grafana" / "vlmq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    # label_values(series{...}, label): the series only
    exprs += [re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", v["query"]["query"])
              for v in dashboard["templating"]["list"]]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - exported_series() == set()
    assert len(used) >= 15  # the dashboard shows most of what is exported
    assert f"{gen_k8s.HELD_METRIC}\t" in (INFRA / "metrics.txt").read_text()  # the KEDA held trigger's series
    assert metric_names('rate(vlmq_jobz_total{status="failed"}[5m])') == {"vlmq_jobz_total"}
    datasource = yaml.safe_load((INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["datasources"][0]["uid"]}
