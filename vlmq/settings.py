"""Settings: the only module that reads ``VLMQ_*`` environment variables."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

ENV_VARS: dict[str, str] = {
    "VLMQ_BROKER_URL": "Redis URL for queues and job records (default redis://127.0.0.1:6379/0)",
    "VLMQ_STORAGE_URL": "s3://bucket/prefix or file:///dir for inputs and results (default file:///tmp/vlmq)",
    "VLMQ_S3_ENDPOINT_URL": "endpoint of an S3-compatible server (else AWS_ENDPOINT_URL or AWS itself)",
    "VLMQ_MODELS": "extra models: name=/path/to/hf-folder[,name2=/path2]",
    "VLMQ_COST_CLASSES": "cost classes as bounds on vision tokens (default xs=256,s=1024,m=4096,l=16384,xl)",
    "VLMQ_TEXT_TOKEN_BOUND": "text tokens (prompt + answer) a job may use, counted in every class cost (default 2048)",
    "VLMQ_MAX_NEW_TOKENS": "largest max_new_tokens a job may ask for (default 1024)",
    "VLMQ_MAX_PROMPT_CHARS": "longest prompt accepted, in characters (default 8000)",
    "VLMQ_MAX_IMAGE_BYTES": "largest image accepted, in bytes (default 20 MiB)",
    "VLMQ_MAX_IMAGE_PIXELS": "largest declared image size, in pixels (default 40,000,000)",
    "VLMQ_JOB_TTL": "seconds a job record is kept after it ends (default 7 days)",
    "VLMQ_MAX_QUEUE_DEPTH": "waiting jobs per class before submit raises QueueFull: N or xs=N,s=M (0 = no limit)",
    "VLMQ_VISIBILITY_TIMEOUT": "seconds before a message held by a dead worker is delivered again (default 300)",
    "VLMQ_MAX_ATTEMPTS": "deliveries that crashed or timed out before a job fails as poison (default 3)",
    "VLMQ_SHUTDOWN_GRACE": "worker: seconds a SIGTERM waits for running jobs before handing them back (default 30)",
    "VLMQ_STORAGE_RETRY": "worker: seconds to retry an unreachable object store, then hand the job back (default 300)",
    "VLMQ_WORKER_BUDGET": "worker: the sum of class cost bounds it may hold at once (default 32768 tokens)",
    "VLMQ_WORKER_BATCH": "worker: most jobs it holds at once (default 16)",
    "VLMQ_WORKER_CLASSES": "worker: cost classes it consumes (default all that fit its budget)",
    "VLMQ_BACKEND": "worker: engine (the vlmq engine; default) or hf (plain transformers generate)",
    "VLMQ_DEVICE": "worker: cpu, cuda or cuda:N (default cpu)",
}

BACKENDS = ("engine", "hf")  # worker backends; the first is the default
DEFAULT_COST_CLASSES = "xs=256,s=1024,m=4096,l=16384,xl"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STORAGE_URL = "file:///tmp/vlmq"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from e


def parse_models(raw: str) -> dict[str, str]:
    """Parse ``name=/path,name2=/path2`` into a mapping."""
    models: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"VLMQ_MODELS entries look like name=/path, got {item!r}")
        models[name.strip()] = path.strip()
    return models


@dataclass(slots=True)
class Settings:
    """Configuration shared by the SDK and the workers.

    Build it with ``Settings.from_env()`` or directly; every limit is explicit.
    """

    broker_url: str = DEFAULT_BROKER_URL
    storage_url: str = DEFAULT_STORAGE_URL
    s3_endpoint_url: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    cost_classes: str = DEFAULT_COST_CLASSES
    text_token_bound: int = 2048
    max_new_tokens: int = 1024
    max_prompt_chars: int = 8000
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    job_ttl: int = 7 * 24 * 3600
    max_queue_depth: str = "0"
    visibility_timeout: int = 300
    max_attempts: int = 3
    shutdown_grace: int = 30
    storage_retry: int = 300
    worker_budget: int = 32768
    worker_batch: int = 16
    worker_classes: str = ""
    backend: str = BACKENDS[0]
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("text_token_bound", "max_new_tokens", "max_prompt_chars", "max_image_bytes",
                     "max_image_pixels", "job_ttl", "worker_budget", "worker_batch", "visibility_timeout",
                     "max_attempts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.broker_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"broker_url must be a redis:// URL, got {self.broker_url!r}")
        if not self.storage_url.startswith(("s3://", "file://")):
            raise ValueError(f"storage_url must be s3://bucket/prefix or file:///dir, got {self.storage_url!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.shutdown_grace < 0 or self.storage_retry < 0:
            raise ValueError("shutdown_grace and storage_retry must not be negative")
        self.queue_depth_limit("xs")  # validates the format

    def queue_depth_limit(self, cost_class: str) -> int:
        """Most jobs allowed to wait in one class queue (0 = no limit)."""
        raw = self.max_queue_depth.strip() or "0"
        try:
            if "=" not in raw:
                return int(raw)
            limits = dict(part.split("=", 1) for part in raw.split(","))
            return int(limits.get(cost_class, "0"))
        except ValueError as e:
            raise ValueError(f"max_queue_depth must be N or xs=N,s=M, got {raw!r}") from e

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``VLMQ_*`` variables (see ``ENV_VARS``); keyword overrides win."""
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "broker_url": env.get("VLMQ_BROKER_URL", DEFAULT_BROKER_URL),
            "storage_url": env.get("VLMQ_STORAGE_URL", DEFAULT_STORAGE_URL),
            "s3_endpoint_url": env.get("VLMQ_S3_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL") or None,
            "models": parse_models(env.get("VLMQ_MODELS", "")),
            "cost_classes": env.get("VLMQ_COST_CLASSES", DEFAULT_COST_CLASSES),
            "text_token_bound": _int(env, "VLMQ_TEXT_TOKEN_BOUND", 2048),
            "max_new_tokens": _int(env, "VLMQ_MAX_NEW_TOKENS", 1024),
            "max_prompt_chars": _int(env, "VLMQ_MAX_PROMPT_CHARS", 8000),
            "max_image_bytes": _int(env, "VLMQ_MAX_IMAGE_BYTES", 20 * 1024 * 1024),
            "max_image_pixels": _int(env, "VLMQ_MAX_IMAGE_PIXELS", 40_000_000),
            "job_ttl": _int(env, "VLMQ_JOB_TTL", 7 * 24 * 3600),
            "max_queue_depth": env.get("VLMQ_MAX_QUEUE_DEPTH", "0"),
            "visibility_timeout": _int(env, "VLMQ_VISIBILITY_TIMEOUT", 300),
            "max_attempts": _int(env, "VLMQ_MAX_ATTEMPTS", 3),
            "shutdown_grace": _int(env, "VLMQ_SHUTDOWN_GRACE", 30),
            "storage_retry": _int(env, "VLMQ_STORAGE_RETRY", 300),
            "worker_budget": _int(env, "VLMQ_WORKER_BUDGET", 32768),
            "worker_batch": _int(env, "VLMQ_WORKER_BATCH", 16),
            "worker_classes": env.get("VLMQ_WORKER_CLASSES", ""),
            "backend": env.get("VLMQ_BACKEND") or BACKENDS[0],
            "device": env.get("VLMQ_DEVICE", "cpu"),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The ``VLMQ_*`` variables that reproduce these settings in a child process."""
        env = {
            "VLMQ_BROKER_URL": self.broker_url,
            "VLMQ_STORAGE_URL": self.storage_url,
            "VLMQ_MODELS": ",".join(f"{k}={v}" for k, v in self.models.items()),
            "VLMQ_COST_CLASSES": self.cost_classes,
            "VLMQ_TEXT_TOKEN_BOUND": str(self.text_token_bound),
            "VLMQ_MAX_NEW_TOKENS": str(self.max_new_tokens),
            "VLMQ_MAX_PROMPT_CHARS": str(self.max_prompt_chars),
            "VLMQ_MAX_IMAGE_BYTES": str(self.max_image_bytes),
            "VLMQ_MAX_IMAGE_PIXELS": str(self.max_image_pixels),
            "VLMQ_JOB_TTL": str(self.job_ttl),
            "VLMQ_MAX_QUEUE_DEPTH": self.max_queue_depth,
            "VLMQ_VISIBILITY_TIMEOUT": str(self.visibility_timeout),
            "VLMQ_MAX_ATTEMPTS": str(self.max_attempts),
            "VLMQ_SHUTDOWN_GRACE": str(self.shutdown_grace),
            "VLMQ_STORAGE_RETRY": str(self.storage_retry),
            "VLMQ_WORKER_BUDGET": str(self.worker_budget),
            "VLMQ_WORKER_BATCH": str(self.worker_batch),
            "VLMQ_WORKER_CLASSES": self.worker_classes,
            "VLMQ_BACKEND": self.backend,
            "VLMQ_DEVICE": self.device,
        }
        if self.s3_endpoint_url:
            env["VLMQ_S3_ENDPOINT_URL"] = self.s3_endpoint_url
        return env
