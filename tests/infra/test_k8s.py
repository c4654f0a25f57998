"""infra/k8s offline: schemas (Kubernetes, KEDA), overlays, and names checked against vlmq.keys and settings."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess

import gen_k8s
import jsonschema
import kubernetes_validate
import pytest
import yaml
from manifests import K8S, build, by_kind, load_all, validate

from vlmq import keys
from vlmq.models import BUNDLED_MODEL, resolve_model
from vlmq.settings import ENV_VARS, Settings, env_name

OVERLAYS = ("gpu", "cpu")


def canonical(objects: list[dict]) -> list[str]:
    return sorted(json.dumps(o, sort_keys=True) for o in objects)


@pytest.fixture(scope="module", params=OVERLAYS)
def built(request: pytest.FixtureRequest) -> list[dict]:
    folder = K8S / "overlays" / request.param
    objects = build(folder)
    if shutil.which("kubectl"):  # the real kustomize, where installed, builds the same objects
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
        assert canonical([o for o in yaml.safe_load_all(out) if o]) == canonical(objects)
    return objects


def config(objects: list[dict]) -> dict[str, str]:
    return by_kind(objects, "ConfigMap")[0]["data"]


def workers(objects: list[dict]) -> list[dict]:
    return [d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
            == "worker"]


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def group_of(deployment: dict) -> list[str]:
    args = container(deployment)["args"]
    return args[args.index("--classes") + 1].split(",")


def test_committed_base_is_what_the_generator_writes() -> None:
    assert gen_k8s.main(["--check"]) == 0, "run python scripts/gen_k8s.py"


def test_every_object_matches_its_schema(built: list[dict]) -> None:
    kinds = {o["kind"] for o in built}
    assert {"Deployment", "PodDisruptionBudget", "ScaledObject", "TriggerAuthentication", "ConfigMap", "Service",
            "HorizontalPodAutoscaler"} <= kinds
    for obj in built + load_all(K8S / "base" / "secret.example.yaml"):
        validate(obj)


def test_schema_checks_refuse_a_misspelt_field(built: list[dict]) -> None:
    scaled = copy.deepcopy(by_kind(built, "ScaledObject")[0])
    scaled["spec"]["cooldownPeriods"] = 300
    with pytest.raises(jsonschema.ValidationError, match="cooldownPeriods"):
        validate(scaled)
    deployment = copy.deepcopy(workers(built)[0])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_each_scaler_watches_every_list_of_its_queues(built: list[dict]) -> None:
    deployments = {d["metadata"]["name"]: d for d in workers(built)}
    auth = by_kind(built, "TriggerAuthentication")[0]["metadata"]["name"]
    for scaled in by_kind(built, "ScaledObject"):
        spec = scaled["spec"]
        deployment = deployments[spec["scaleTargetRef"]["name"]]
        model = container(deployment)["args"][container(deployment)["args"].index("--model") + 1]
        expected = [name for c in group_of(deployment) for name in keys.queue_lists(keys.queue(model, c))]
        lists = [t for t in spec["triggers"] if t["type"] == "redis"]
        assert [t["metadata"]["listName"] for t in lists] == expected
        assert len(expected) == len(group_of(deployment)) * len(keys.PRIORITY_STEPS)
        # KEDA takes the max over triggers: the formula must add every list up
        formula = spec["advanced"]["scalingModifiers"]["formula"]
        assert sorted(formula.split(" + ")) == sorted(t["name"] for t in spec["triggers"])
        assert spec["minReplicaCount"] == 0 and spec["cooldownPeriod"] >= 60
        (held,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
        assert held["name"] == "held"
        classes = "|".join(group_of(deployment))
        assert f'{gen_k8s.HELD_METRIC}{{model="{model}",class=~"{classes}"}}' in held["metadata"]["query"]
        for trigger in lists:
            assert trigger["metadata"]["addressFromEnv"] in config(built)
            assert trigger["authenticationRef"]["name"] == auth


def test_every_class_the_model_can_reach_has_a_scaler(built: list[dict]) -> None:
    settings = Settings()
    spec = resolve_model(BUNDLED_MODEL, settings)
    watched = {t["metadata"].get("listName") for s in by_kind(built, "ScaledObject") for t in s["spec"]["triggers"]}
    for cost_class in gen_k8s.reachable_classes(spec, settings):
        assert set(keys.queue_lists(keys.queue(BUNDLED_MODEL, cost_class))) <= watched, cost_class
    # tiny-shapes caps an image at 334 vision tokens: xs and s only
    assert gen_k8s.reachable_classes(spec, settings) == ["xs", "s"]


def test_worker_stops_gracefully_and_probes_the_metrics_port(built: list[dict]) -> None:
    data = config(built)
    grace = int(data["VLMQ_SHUTDOWN_GRACE"])
    assert grace >= Settings().shutdown_grace
    port = int(data[env_name("metrics_port")])
    pdbs = {p["metadata"]["name"]: p for p in by_kind(built, "PodDisruptionBudget")}
    for deployment in workers(built):
        pod = deployment["spec"]["template"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > grace
        c = container(deployment)
        assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert "kill -TERM 1" in c["lifecycle"]["preStop"]["exec"]["command"][-1]
        pdb = pdbs[deployment["metadata"]["name"]]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert deployment["metadata"]["labels"]["vlmq.io/classes"] == "-".join(group_of(deployment))


def test_serve_is_stateless_behind_a_service_with_a_budget_and_cpu_autoscaling(built: list[dict]) -> None:
    [serve] = [d for d in by_kind(built, "Deployment") if d["metadata"]["name"] == "vlmq-serve"]
    box = container(serve)
    assert box["args"][:1] == ["serve"] and box["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "volumes" not in serve["spec"]["template"]["spec"]  # no state of its own: replicas are interchangeable
    [service] = [s for s in by_kind(built, "Service") if s["metadata"]["name"] == "vlmq-serve"]
    assert service["spec"]["selector"] == serve["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == box["ports"][0]["name"]
    [budget] = [p for p in by_kind(built, "PodDisruptionBudget") if p["metadata"]["name"] == "vlmq-serve"]
    assert budget["spec"]["minAvailable"] == 1 and serve["spec"]["replicas"] >= 2
    [hpa] = by_kind(built, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vlmq-serve" and hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_env_names_are_settings(built: list[dict]) -> None:
    names = set(config(built))
    names |= set(load_all(K8S / "base" / "secret.example.yaml")[0]["stringData"])
    names |= {e["name"] for d in by_kind(built, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]
              for e in c.get("env", [])}
    vlmq_names = {n for n in names if n.startswith("VLMQ_")}
    assert vlmq_names - set(ENV_VARS) == set()
    assert {"VLMQ_BROKER_URL", "VLMQ_STORAGE_URL", "VLMQ_SHUTDOWN_GRACE", "VLMQ_DEVICE"} <= vlmq_names
    assert names - vlmq_names <= {gen_k8s.REDIS_ADDRESS_ENV, gen_k8s.REDIS_PASSWORD_KEY, "AWS_DEFAULT_REGION",
                                  "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # the secret carries what KEDA's TriggerAuthentication reads
    auth = by_kind(built, "TriggerAuthentication")[0]["spec"]["secretTargetRef"][0]
    assert auth["key"] in load_all(K8S / "base" / "secret.example.yaml")[0]["stringData"]


def test_redis_address_agrees_with_the_broker_url(built: list[dict]) -> None:
    broker = load_all(K8S / "base" / "secret.example.yaml")[0]["stringData"]["VLMQ_BROKER_URL"]
    assert broker.split("@", 1)[1].rsplit("/", 1)[0] == config(built)[gen_k8s.REDIS_ADDRESS_ENV]
    for scaled in by_kind(built, "ScaledObject"):
        redis = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis"]
        assert {t["metadata"]["databaseIndex"] for t in redis} == {broker.rsplit("/", 1)[1]}


def test_gpu_overlay_requests_one_gpu_per_worker_and_cpu_none() -> None:
    gpu, cpu = build(K8S / "overlays" / "gpu"), build(K8S / "overlays" / "cpu")
    for deployment in workers(gpu):
        c = container(deployment)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
        assert {"name": "VLMQ_DEVICE", "value": "cuda"} in c["env"]
    for deployment in workers(cpu):
        c = container(deployment)
        assert "nvidia.com/gpu" not in json.dumps(c["resources"])
        assert {"name": "VLMQ_DEVICE", "value": "cpu"} in c["env"] and c["image"].endswith("-cpu")
    delivery = [d for d in by_kind(gpu, "Deployment") if d["metadata"]["name"] == "vlmq-delivery"]
    assert "nvidia.com/gpu" not in json.dumps(delivery) and container(delivery[0])["args"] == ["delivery"]


def test_groups_make_one_scaler_per_deployment(tmp_path) -> None:
    assert gen_k8s.main(["--groups", "xs,s;m", "--out", str(tmp_path)]) == 0
    objects = load_all(tmp_path / "workers-tiny-shapes.yaml")
    (scaled,) = by_kind(objects, "ScaledObject")  # m is out of tiny-shapes' reach: no Deployment for it
    assert len(scaled["spec"]["triggers"]) == 2 * len(keys.PRIORITY_STEPS) + 1  # + held
    for obj in objects:
        validate(obj)
    assert gen_k8s.main(["--prometheus-url", "", "--out", str(tmp_path)]) == 0
    for scaled in by_kind(load_all(tmp_path / "workers-tiny-shapes.yaml"), "ScaledObject"):
        assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis"}
        assert "held" not in scaled["spec"]["advanced"]["scalingModifiers"]["formula"]
    with pytest.raises(ValueError, match="unknown classes"):
        gen_k8s.main(["--groups", "xs,huge", "--out", str(tmp_path)])
