"""Generate the Kubernetes base manifests (infra/k8s/base/) from vlmq.keys and the settings table.

    python scripts/gen_k8s.py                       # rewrite infra/k8s/base for the bundled model
    python scripts/gen_k8s.py --model tiny-shapes --model qwen2-vl-7b --groups "xs,s;m;l,xl"
    python scripts/gen_k8s.py --check               # exit 1 if the committed files are stale

Per model and cost-class group: one worker Deployment (``vlmq worker --model M --classes G``), a
PodDisruptionBudget and a KEDA ScaledObject. KEDA allows one ScaledObject per Deployment, so the
ScaledObject of a group sums (``advanced.scalingModifiers.formula``) one Redis ``lists`` trigger for
every list that holds the group's waiting work: for each class, ``keys.queue_lists(keys.queue(M, C))``,
kombu's bare queue list plus one list per priority step; and one Prometheus trigger, ``held``, for the
jobs workers already hold (kombu keeps them in one hash for all queues, so Redis cannot count them per
class; the workers export the count). Without it a pool that keeps up sees empty lists, scales to zero
after the cooldown and pays a cold start (scripts/sim_autoscale.py shows the difference). The default
group is one class, so the
default is one Deployment and one ScaledObject per (model, class). Classes no image of the model can
reach (its resolution policy caps the vision tokens) get no Deployment.

Queue names, priority lists and every ``VLMQ_*`` name come from ``vlmq.keys`` and ``vlmq.settings``;
the tests in tests/infra/ check the committed files against them.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from vlmq import keys
from vlmq.models import BUNDLED_MODEL, ModelSpec, cost_classes, resolve_model
from vlmq.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "infra" / "k8s" / "base"
NAMESPACE = "vlmq"
METRICS_PORT = 9464  # VLMQ_METRICS_PORT in every manifest; the compose file and Prometheus config agree
WORKER_IMAGE = "ghcr.io/vlmq/vlmq-worker:0.1.0"
PRODUCER_IMAGE = "ghcr.io/vlmq/vlmq:0.1.0"
CONFIG, SECRET, TRIGGER_AUTH = "vlmq-config", "vlmq-secrets", "vlmq-redis"
REDIS_ADDRESS_ENV = "REDIS_ADDRESS"  # host:port for KEDA's Redis scaler (it takes no redis:// URL)
REDIS_PASSWORD_KEY = "REDIS_PASSWORD"
SHUTDOWN_GRACE = 120  # VLMQ_SHUTDOWN_GRACE in the ConfigMap: a GPU batch's running jobs get two minutes
STOP_MARGIN = 60  # terminationGracePeriodSeconds = grace + margin: hand-back and exit after the grace
PROMETHEUS_URL = "http://prometheus.monitoring.svc:9090"  # where the workers' metrics are scraped (--prometheus-url)
HELD_METRIC = "vlmq_queue_unacked"  # jobs workers hold, per (model, class): infra/metrics.txt
POLLING_S, COOLDOWN_S, SCALE_DOWN_WINDOW_S, SCALE_DOWN_PERIOD_S = 15, 300, 300, 60
MAX_REPLICAS = 8
SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}}  # the images' own user (infra/docker)
WORKER_LABEL = {"app.kubernetes.io/name": "vlmq", "app.kubernetes.io/component": "worker"}


def dns_name(text: str) -> str:
    """A Kubernetes object name part: lowercase alphanumerics and '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name:
        raise ValueError(f"cannot make a Kubernetes name from {text!r}")
    return name


def reachable_classes(spec: ModelSpec, settings: Settings) -> list[str]:
    """Cost classes a job for this model can land in: those whose lower bound is below the model's cap."""
    classes, top = cost_classes(settings), spec.policy.max_vision_tokens()
    lower = [0, *(bound for _, bound in classes.bounds)]
    return [name for name, low in zip(classes.names, lower, strict=True) if low < top]


def parse_groups(raw: str, classes: list[str], known: tuple[str, ...]) -> list[list[str]]:
    """``"xs,s;m"`` -> [[xs, s], [m]] restricted to ``classes``; empty -> one group per class."""
    if not raw.strip():
        return [[c] for c in classes]
    named = [[c.strip() for c in part.split(",") if c.strip()] for part in raw.split(";")]
    if unknown := sorted({c for group in named for c in group} - set(known)):
        raise ValueError(f"--groups names unknown classes {unknown}; known: {', '.join(known)}")
    return [g for g in ([c for c in group if c in classes] for group in named) if g]


def trigger_name(cost_class: str, priority: int) -> str:
    """A trigger name usable in a KEDA formula (an identifier): ``xs_p0``."""
    return f"{dns_name(cost_class).replace('-', '_')}_p{priority}"


def worker_name(model: str, group: list[str]) -> str:
    return f"vlmq-worker-{dns_name(model)}-{'-'.join(dns_name(c) for c in group)}"


def labels(model: str, group: list[str]) -> dict[str, str]:
    return {**WORKER_LABEL, "vlmq.io/model": dns_name(model), "vlmq.io/classes": "-".join(group)}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def worker_container(model: str, group: list[str]) -> dict[str, Any]:
    return {
        "name": "worker",
        "image": WORKER_IMAGE,
        "args": ["worker", "--model", model, "--classes", ",".join(group)],
        "envFrom": [{"configMapRef": {"name": CONFIG}}, {"secretRef": {"name": SECRET}}],
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # model loading may take minutes: the startup probe holds liveness off for up to 20 minutes
        "startupProbe": _probe("/healthz", 10, 120),
        "livenessProbe": _probe("/healthz", 15, 4),  # the step loop is alive
        "readinessProbe": _probe("/readyz", 10, 3),  # the broker connection is up
        "lifecycle": {"preStop": {"exec": {"command": [
            # tini (PID 1) passes SIGTERM to the worker, which stops taking work, lets its running jobs finish
            # for VLMQ_SHUTDOWN_GRACE s and hands the rest back; the hook returns when the worker has exited
            "sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"]}}},
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        "securityContext": SECURITY,
    }


def worker_deployment(model: str, group: list[str]) -> dict[str, Any]:
    name, lab = worker_name(model, group), labels(model, group)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": lab},
        "spec": {  # no replicas: KEDA's HPA owns the count (0 when idle)
            "selector": {"matchLabels": lab},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": lab, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                    "prometheus.io/path": "/metrics"}},
                "spec": {"terminationGracePeriodSeconds": SHUTDOWN_GRACE + STOP_MARGIN,
                         "containers": [worker_container(model, group)]},
            },
        },
    }


def disruption_budget(model: str, group: list[str]) -> dict[str, Any]:
    # a node drain evicts one worker of a group at a time; each one still gets its graceful stop
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": worker_name(model, group), "labels": labels(model, group)},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(model, group)}}}


def held_trigger(model: str, group: list[str], prometheus_url: str) -> dict[str, Any]:
    classes = "|".join(re.escape(c) for c in group)
    query = f'sum(max by (class) ({HELD_METRIC}{{model="{model}",class=~"{classes}"}}))'
    return {"type": "prometheus", "name": "held",
            "metadata": {"serverAddress": prometheus_url, "query": query, "threshold": "1",
                         "ignoreNullValues": "true"}}


def scaled_object(model: str, group: list[str], database: int, settings: Settings,
                  prometheus_url: str = PROMETHEUS_URL) -> dict[str, Any]:
    triggers = []
    for cost_class in group:
        queue = keys.queue(model, cost_class)
        for priority, list_name in zip(keys.PRIORITY_STEPS, keys.queue_lists(queue), strict=True):
            triggers.append({"type": "redis", "name": trigger_name(cost_class, priority),
                             "authenticationRef": {"name": TRIGGER_AUTH},
                             "metadata": {"addressFromEnv": REDIS_ADDRESS_ENV, "listName": list_name,
                                          "databaseIndex": str(database), "listLength": "1"}})
    if prometheus_url:  # without Prometheus in the cluster: lists only (see the module docstring)
        triggers.append(held_trigger(model, group, prometheus_url))
    per_replica = settings.worker_batch  # waiting jobs per replica before another one is added
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": worker_name(model, group), "labels": labels(model, group)},
        "spec": {
            "scaleTargetRef": {"name": worker_name(model, group)},
            "pollingInterval": POLLING_S, "cooldownPeriod": COOLDOWN_S,
            "minReplicaCount": 0, "maxReplicaCount": MAX_REPLICAS,
            "advanced": {
                "scalingModifiers": {"formula": " + ".join(t["name"] for t in triggers),
                                     "target": str(per_replica), "activationTarget": "0",
                                     "metricType": "AverageValue"},
                "horizontalPodAutoscalerConfig": {"behavior": {
                    "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
                                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": SCALE_DOWN_PERIOD_S}]}}},
            },
            "triggers": triggers,
        },
    }


def config_objects(settings: Settings) -> list[dict[str, Any]]:
    data = {env_name("storage_url"): "s3://vlmq/pool", env_name("s3_endpoint_url"): "",
            env_name("shutdown_grace"): str(SHUTDOWN_GRACE),
            env_name("visibility_timeout"): str(settings.visibility_timeout),
            env_name("worker_budget"): str(settings.worker_budget),
            env_name("worker_batch"): str(settings.worker_batch),
            env_name("metrics_port"): str(METRICS_PORT), env_name("worker_events"): "1",
            REDIS_ADDRESS_ENV: "valkey.vlmq.svc:6379", "AWS_DEFAULT_REGION": "us-east-1"}
    auth = {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication", "metadata": {"name": TRIGGER_AUTH},
            "spec": {"secretTargetRef": [{"parameter": "password", "name": SECRET, "key": REDIS_PASSWORD_KEY}]}}
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIG}, "data": data}, auth]


def secret_example() -> dict[str, Any]:
    """The Secret the operator creates (never committed with real values): credentials only."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "type": "Opaque",
            "stringData": {env_name("broker_url"): "redis://:CHANGE-ME@valkey.vlmq.svc:6379/0",
                           REDIS_PASSWORD_KEY: "CHANGE-ME", "AWS_ACCESS_KEY_ID": "CHANGE-ME",
                           "AWS_SECRET_ACCESS_KEY": "CHANGE-ME",
                           env_name("kv_archive_key"): "CHANGE-ME-openssl-rand-hex-32"}}


def delivery_deployment() -> dict[str, Any]:
    lab = {"app.kubernetes.io/name": "vlmq", "app.kubernetes.io/component": "delivery"}
    container = {"name": "delivery", "image": PRODUCER_IMAGE, "args": ["delivery"],
                 "envFrom": [{"configMapRef": {"name": CONFIG}}, {"secretRef": {"name": SECRET}}],
                 "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "securityContext": SECURITY}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vlmq-delivery", "labels": lab},
            "spec": {"replicas": 2, "selector": {"matchLabels": lab},
                     "template": {"metadata": {"labels": lab}, "spec": {"containers": [container]}}}}


SERVE_PORT = 8000  # vlmq serve's container port (the Service maps port 80 to it)
SERVE_LABEL = {"app.kubernetes.io/name": "vlmq", "app.kubernetes.io/component": "serve"}


def _serve_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def serve_objects() -> list[dict[str, Any]]:
    """``vlmq serve`` (the OpenAI API): a stateless Deployment behind a Service, a PDB, an HPA on CPU."""
    meta = {"name": "vlmq-serve", "labels": SERVE_LABEL}
    container = {"name": "serve", "image": PRODUCER_IMAGE,
                 "args": ["serve", "--host", "0.0.0.0", "--port", str(SERVE_PORT)],
                 "envFrom": [{"configMapRef": {"name": CONFIG}}, {"secretRef": {"name": SECRET}}],
                 "ports": [{"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"}],
                 "livenessProbe": _serve_probe("/healthz", 10, 3),
                 "readinessProbe": _serve_probe("/readyz", 5, 2),  # Redis and the object store answer
                 "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                 "securityContext": SECURITY}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                  "spec": {"replicas": 2, "selector": {"matchLabels": SERVE_LABEL},
                           "template": {"metadata": {"labels": SERVE_LABEL},
                                        "spec": {"containers": [container], "terminationGracePeriodSeconds": 30}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"selector": SERVE_LABEL, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
              "spec": {"minAvailable": 1, "selector": {"matchLabels": SERVE_LABEL}}}
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vlmq-serve"},
                    "minReplicas": 2, "maxReplicas": MAX_REPLICAS,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 70}}}]}}
    return [deployment, service, budget, hpa]


def header(what: str) -> str:
    return f"# generated by scripts/gen_k8s.py ({what}); edit the script, not this file\n"


class _PlainDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: each object reads on its own
        return True


def dump(objects: list[dict[str, Any]], what: str) -> str:
    return header(what) + yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, width=120)


def broker_database(settings: Settings) -> int:
    path = settings.broker_url.rsplit("/", 1)[-1]
    return int(path) if path.isdigit() else 0


def render(models: list[str], groups_arg: str, settings: Settings,
           prometheus_url: str = PROMETHEUS_URL) -> dict[str, str]:
    """File name (under infra/k8s/base) -> text."""
    files = {"namespace.yaml": dump([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}],
                                    "namespace"),
             "config.yaml": dump(config_objects(settings), "ConfigMap for VLMQ_* and AWS, KEDA's Redis auth"),
             "secret.example.yaml": dump([secret_example()], "create it with real values; not in kustomization"),
             "delivery.yaml": dump([delivery_deployment()], "webhook delivery workers"),
             "serve.yaml": dump(serve_objects(), "vlmq serve: the OpenAI API")}
    for model in models:
        spec = resolve_model(model, settings)
        objects = []
        known = cost_classes(settings).names
        for group in parse_groups(groups_arg, reachable_classes(spec, settings), known):
            objects += [worker_deployment(model, group), disruption_budget(model, group),
                        scaled_object(model, group, broker_database(settings), settings, prometheus_url)]
        files[f"workers-{dns_name(model)}.yaml"] = dump(objects, f"model {model}")
    resources = [name for name in files if name != "secret.example.yaml"]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "namespace": NAMESPACE, "resources": resources}
    files["kustomization.yaml"] = dump([kustomization], "base")
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help=f"model name (repeatable; default {BUNDLED_MODEL})")
    ap.add_argument("--groups", default="", help='cost-class groups, e.g. "xs,s;m" (default: one per class)')
    ap.add_argument("--prometheus-url", default=PROMETHEUS_URL,
                    help="Prometheus that scrapes the workers, for the held-jobs trigger ('' = lists only)")
    ap.add_argument("--out", type=Path, default=BASE)
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = ap.parse_args(argv)
    # defaults, not this shell's VLMQ_* values (the files must not depend on who ran the script); only the
    # model table comes from VLMQ_MODELS, so operators can generate their own models' objects
    files = render(args.model or [BUNDLED_MODEL], args.groups, Settings(models=Settings.from_env().models),
                   args.prometheus_url)
    stale = [name for name, text in files.items()
             if not (args.out / name).exists() or (args.out / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"stale: {args.out / name} (run python scripts/gen_k8s.py)")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (args.out / name).write_text(files[name])
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
