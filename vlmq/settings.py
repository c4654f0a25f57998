"""Settings: the only module that reads ``VLMQ_*`` environment variables.

Each setting is declared once, as a field of ``Settings``: its name (``VLMQ_`` + the field name in
capitals), type, default, who reads it (producers, workers, or both) and a one-line meaning.
``Settings.from_env``, ``Settings.to_env`` and the configuration tables all come from these declarations:
the README lists what producers read (``python -m vlmq.settings --update-readme README.md`` rewrites it in
place), ``docs/configuration.md`` what only workers read (``--update-docs docs/configuration.md``);
``--markdown`` prints every table.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmq.keys import check_tenant

BACKENDS = ("engine", "hf")  # worker backends; the first is the default
LOG_FORMATS = ("text", "json")  # worker log formats; the first is the default
DEFAULT_COST_CLASSES = "xs=256,s=1024,m=4096,l=16384,xl"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STORAGE_URL = "file:///tmp/vlmq"
MIN_ARCHIVE_KEY_CHARS = 32
# seconds before each webhook retry (the first attempt is immediate): Standard Webhooks' schedule, about 75 h
DEFAULT_RETRY_SCHEDULE = "5,300,1800,7200,18000,36000,50400,72000,86400"

BOTH, PRODUCER, WORKER = "both", "producer", "worker"
READERS = {BOTH: "Read by producers and workers", PRODUCER: "Read by producers (the SDK)",
           WORKER: "Read by workers"}
README_BEGIN = "<!-- settings-table:begin (generated: python -m vlmq.settings --update-readme README.md) -->"
DOCS_BEGIN = "<!-- settings-table:begin (generated: python -m vlmq.settings --update-docs docs/configuration.md) -->"
README_END = "<!-- settings-table:end -->"
# whose settings the README's generated table lists, and docs/configuration.md's (together: every setting)
README_READERS, DOCS_READERS = (BOTH, PRODUCER), (WORKER,)


def parse_models(raw: str) -> dict[str, str]:
    """Parse ``name=/path,name2=/path2`` into a mapping."""
    models: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"VLMQ_MODELS entries look like name=/path, got {item!r}")
        models[name.strip()] = path.strip()
    return models


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("must be an integer") from None


def parse_delays(raw: str) -> tuple[float, ...]:
    """Parse ``5,300,1800`` (seconds, each > 0) into a tuple."""
    try:
        delays = tuple(float(part) for part in raw.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"must be seconds separated by commas, e.g. 5,300,1800; got {raw!r}") from None
    if not delays or min(delays) <= 0:
        raise ValueError(f"must list at least one positive delay in seconds, got {raw!r}")
    return delays


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError("must be 1 or 0 (on or off)")


def _format_flag(value: bool) -> str:
    return "1" if value else "0"


def _format_models(models: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in models.items())


def _setting(default: Any, reader: str, meaning: str, *, shown: str | None = None,
             parse: Callable[[str], Any] | None = None, to_text: Callable[[Any], str] = str,
             fallback: str | None = None) -> Any:
    """Declare one setting (a dataclass field whose metadata drives env parsing, ``to_env`` and the README).

    Args:
        default: the default value (a dict default is copied for each instance).
        reader: ``producer``, ``worker`` or ``both``.
        meaning: one line for the README.
        shown: the default as the README shows it (else the value itself).
        parse: text to value (else ``int`` for int defaults, the text itself otherwise).
        to_text: value to text for ``to_env``.
        fallback: another environment variable read when ours is unset.
    """
    if parse is None:
        parse = _int if isinstance(default, int) else str
    meta = {"reader": reader, "meaning": meaning, "shown": shown, "parse": parse, "to_text": to_text,
            "fallback": fallback}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(slots=True)
class Settings:
    """Configuration shared by the SDK and the workers.

    Build it with ``Settings.from_env()`` or directly; every limit is explicit.
    """

    # -- read by producers and workers ---------------------------------------------------------
    broker_url: str = _setting(DEFAULT_BROKER_URL, BOTH, "Redis URL for queues and job records")
    storage_url: str = _setting(DEFAULT_STORAGE_URL, BOTH,
                                "`s3://bucket/prefix` or `file:///dir` for inputs and results")
    s3_endpoint_url: str | None = _setting(None, BOTH, "endpoint of an S3-compatible server (credentials from "
                                           "the usual AWS variables)", shown="`AWS_ENDPOINT_URL`, else AWS",
                                           fallback="AWS_ENDPOINT_URL")
    models: dict[str, str] = _setting({}, BOTH, "extra models: `name=/path/to/hf-folder[,name2=/path2]`",
                                      shown="only the bundled `tiny-shapes`", parse=parse_models,
                                      to_text=_format_models)
    cost_classes: str = _setting(DEFAULT_COST_CLASSES, BOTH, "cost classes as bounds on vision tokens")
    text_token_bound: int = _setting(2048, BOTH, "text tokens (prompt + answer) a job may use: counted in every "
                                     "class cost, checked at submit and by workers")
    max_new_tokens: int = _setting(1024, BOTH, "largest `max_new_tokens` a job may ask for (workers re-check it)")
    max_prompt_chars: int = _setting(8000, BOTH, "longest prompt accepted, in characters (workers re-check it)")
    max_images_per_job: int = _setting(16, BOTH, "most images one job's messages may hold (workers re-check it)")
    max_image_bytes: int = _setting(20 * 1024 * 1024, BOTH, "largest image accepted, in bytes",
                                    shown="20 MiB")
    max_image_pixels: int = _setting(40_000_000, BOTH, "largest declared image size, in pixels",
                                     shown="40,000,000")
    job_ttl: int = _setting(7 * 24 * 3600, BOTH, "seconds a job record, cancel flag and idempotency key are "
                            "kept: from submit, and a record again from the job's end",
                            shown="604800 (7 days)")
    webhook_allow: str = _setting("", BOTH, "networks exempt from the webhook address guard (loopback, private, "
                                  "link-local, metadata, multicast are refused), e.g. `127.0.0.1/32`",
                                  shown="none")
    image_fetch_allow: str = _setting("", BOTH, "where `https://` and `s3://` images may be fetched from: host "
                                      "names (`img.example.com`, `*.cdn.example.com`) and buckets "
                                      "(`s3://bucket`), commas or spaces; anything else is `fetch_refused`",
                                      shown="none (only the pool's own storage)")
    image_fetch_networks: str = _setting("", BOTH, "networks exempt from the image-fetch address guard (the "
                                         "webhook guard's rules), e.g. `127.0.0.1/32`", shown="none")
    image_fetch_timeout: float = _setting(30.0, BOTH, "seconds one attempt of an image fetch may take in all "
                                          "(every redirect hop, TLS handshake and read together)", parse=float)
    image_fetch_redirects: int = _setting(3, BOTH, "most redirects an image fetch follows (each hop checked "
                                          "again)")
    image_fetch_retries: int = _setting(2, BOTH, "retries of an image fetch after a 5xx answer, a timeout or a "
                                        "connection error (backoff 0.5 s, doubling)")
    image_fetch_ca_file: str = _setting("", BOTH, "PEM file of CA certificates trusted for `https://` images "
                                        "besides the system's", shown="none (the system's trust store)")
    affinity: bool = _setting(True, BOTH, "cache-affinity routing: producers send a job whose image is hot on a "
                              "live worker to that worker's own queue, which it consumes first; `0` turns it off "
                              "(only speed changes)", shown="`1` (on)", parse=_flag, to_text=_format_flag)
    affinity_queue_bound: int = _setting(32, BOTH, "jobs a worker's own queue may hold: producers route to the "
                                         "shared queue past it, live workers move the excess there")
    # -- read by producers (the SDK) -----------------------------------------------------------
    webhook_url: str = _setting("", PRODUCER, "default webhook of every job this producer submits "
                                "(`Client(webhook=...)` and `submit(webhook=...)` override it)", shown="none")
    max_queue_depth: str = _setting("0", PRODUCER, "waiting jobs allowed per class, `N` or `xs=N,s=M`; a submit "
                                    "that would pass it raises `QueueFull`", shown="`0` (no limit)")
    batch_max_bad_share: float = _setting(0.5, PRODUCER, "share of a batch file's lines that may be bad (each "
                                          "goes to the error file, the rest run); past it the file is refused "
                                          "whole and nothing runs", parse=float)
    tenant: str = _setting("", PRODUCER, "tenant id (`[a-z0-9-]`, at most 32): scopes this producer's job ids, "
                           "keys and storage prefix (see docs/security.md)", shown="none (untenanted)")
    serve_max_file_bytes: int = _setting(200 << 20, PRODUCER, "`vlmq serve`: largest upload to `/v1/files`, in "
                                         "bytes (OpenAI's 200 MB)", shown="209715200 (200 MiB)")
    serve_max_file_lines: int = _setting(50_000, PRODUCER, "`vlmq serve`: most requests (lines) in an uploaded "
                                         "batch file (OpenAI's)")
    serve_max_body_bytes: int = _setting(32 << 20, PRODUCER, "`vlmq serve`: largest JSON request body, in bytes "
                                         "(a chat request carries its data: images)", shown="33554432 (32 MiB)")
    serve_max_json_depth: int = _setting(64, PRODUCER, "`vlmq serve`: deepest nesting of a JSON body; deeper is "
                                         "refused before it is parsed")
    serve_read_timeout: float = _setting(30.0, PRODUCER, "`vlmq serve`: seconds a client may leave between two "
                                         "chunks of its request body (slow clients get 408)", parse=float)
    serve_body_timeout: float = _setting(900.0, PRODUCER, "`vlmq serve`: seconds a whole request body may take",
                                         parse=float)
    serve_chat_timeout: float = _setting(300.0, PRODUCER, "`vlmq serve`: seconds `/v1/chat/completions` waits for "
                                         "its job (then 504; the job is cancelled)", parse=float)
    # -- read by workers -----------------------------------------------------------------------
    visibility_timeout: int = _setting(300, WORKER, "seconds before a dead worker's messages are delivered "
                                       "again (live workers renew theirs)")
    max_attempts: int = _setting(3, WORKER, "deliveries that crashed or timed out before a job fails as `poison`")
    shutdown_grace: int = _setting(30, WORKER, "seconds SIGTERM waits for running jobs before handing them back")
    storage_retry: int = _setting(300, WORKER, "seconds to retry an unreachable object store before handing a "
                                  "job back")
    orphan_grace: int = _setting(60, WORKER, "seconds, beyond the visibility timeout, a queued or started job's "
                                 "message may be missing from every queue and the unacked hash before the orphan "
                                 "sweep re-sends it from the job record")
    worker_budget: int = _setting(32768, WORKER, "sum of class cost bounds it may hold at once, in tokens")
    worker_batch: int = _setting(16, WORKER, "most jobs it holds at once")
    worker_classes: str = _setting("", WORKER, "cost classes it consumes, e.g. `xs,s`",
                                   shown="all that fit its budget")
    retention: int = _setting(0, WORKER, "seconds `inputs/` and `results/` objects are kept; workers delete older "
                              "ones (inputs of queued or running jobs excepted), one sweep per fleet per period",
                              shown="`0` (keep forever)")
    backend: str = _setting(BACKENDS[0], WORKER, "`engine` (the vlmq engine) or `hf` (plain transformers "
                            "`generate`)")
    device: str = _setting("cpu", WORKER, "`cpu`, `cuda` or `cuda:N`")
    webhook_secrets: str = _setting("", WORKER, "delivery workers' signing secrets, `whsec_...` separated by "
                                    "spaces; each one signs every message (rotation)", shown="none")
    webhook_retry_schedule: str = _setting(DEFAULT_RETRY_SCHEDULE, WORKER, "seconds before each webhook retry "
                                           "(±20% jitter; the first attempt is immediate)",
                                           shown="`5,300,1800,...,86400` (about 75 h)")
    webhook_timeout: float = _setting(15.0, WORKER, "seconds a webhook request may take (its connect, TLS "
                                      "handshake, each read, and the whole)", parse=float)
    webhook_concurrency: int = _setting(16, WORKER, "webhook requests one delivery worker sends at once")
    webhook_ca_file: str = _setting("", WORKER, "PEM file of CA certificates that delivery workers trust for "
                                    "`https://` webhooks besides the system's (a private CA)",
                                    shown="none (the system's trust store)")
    webhook_inline_max: int = _setting(16384, WORKER, "largest result put in a webhook body, in bytes; a larger "
                                       "one is sent as `result_url` (S3) and `result_key`")
    webhook_poll: float = _setting(0.5, WORKER, "seconds between the delivery workers' looks for due events",
                                   parse=float)
    fake_gpus: str = _setting("", WORKER, "GPU ids that `--gpus` runs on the CPU instead, e.g. `0,1` (tries the "
                              "per-GPU supervisor on a machine without GPUs)", shown="none")
    metrics_port: int = _setting(0, WORKER, "port of the worker's `/metrics` (Prometheus), `/healthz` and "
                                 "`/readyz`; with `--gpus` the worker of the N-th GPU listens on port + N",
                                 shown="`0` (off)")
    worker_events: bool = _setting(False, WORKER, "`1`: send Celery task events and event heartbeats (for Flower)",
                                   shown="`0`", parse=_flag, to_text=_format_flag)
    log_format: str = _setting(LOG_FORMATS[0], WORKER, "`text`, or `json`: one JSON object per line with job id, "
                               "model, class, worker and phase")
    kv_archive: int = _setting(1, WORKER, "`1`: archive vision encoder outputs and evicted prefix KV in the pool's "
                               "storage under `kv/<weights hash>/` (any worker reuses them; needs "
                               "`VLMQ_KV_ARCHIVE_KEY`); `0`: off")
    kv_archive_key: str = _setting("", WORKER, "secret that signs and verifies archived KV, at least 32 characters "
                                   "(`openssl rand -hex 32`): the same on every worker of the pool, never given to "
                                   "producers; unset: the archive is off (`vlmq up` makes one for its workers)",
                                   shown="none (archive off)")
    kv_archive_bytes: int = _setting(16 << 30, WORKER, "bound on the whole KV archive (every model), in bytes; "
                                     "the oldest objects are deleted first", shown="17179869184 (16 GiB)")
    kv_archive_quant: str = _setting("", WORKER, "archive encoding: lossless, or `int8` / `fp8` for every model, or "
                                     "per model `name=int8,name2=fp8`", shown="none (lossless)")
    kv_host_bytes: int = _setting(512 << 20, WORKER, "host-memory tier below the engine's caches, in bytes "
                                  "(`0`: none)", shown="536870912 (512 MiB)")
    kv_disk_dir: str = _setting("", WORKER, "local-disk tier folder (emptied at start; one per worker)",
                                shown="none (no disk tier)")
    kv_disk_bytes: int = _setting(0, WORKER, "local-disk tier bound, in bytes")
    tenant_cache_sharing: bool = _setting(False, WORKER, "`1`: jobs of different tenants share encoder outputs, "
                                          "prefix KV and archived KV (faster, but a tenant can tell by timing "
                                          "that another sent the same image and prompt); `0`: each tenant's "
                                          "caches are its own", shown="`0` (off)", parse=_flag,
                                          to_text=_format_flag)
    affinity_ttl: int = _setting(30, WORKER, "seconds a worker's heartbeat, cache counters and hot-image routes "
                                 "live unless renewed (renewed every third of it); a dead worker's own queue "
                                 "drains back to the shared queue after it")
    speculative: str = _setting("", WORKER, "speculative decoding in the engine backend: `ngram`, `draft:<path>` "
                                "(a small text LM with the model's tokenizer; relative to the model folder), "
                                "`head` (the model folder's `spec-head`) or `none`; unset: what the model folder "
                                "names in its `vlmq.json` (tiny-shapes: `head`), else none",
                                shown="the model's default")

    def __post_init__(self) -> None:
        for name in ("text_token_bound", "max_new_tokens", "max_prompt_chars", "max_images_per_job",
                     "max_image_bytes", "max_image_pixels", "job_ttl", "worker_budget", "worker_batch",
                     "visibility_timeout", "max_attempts", "affinity_queue_bound", "affinity_ttl",
                     "serve_max_file_bytes", "serve_max_file_lines", "serve_max_body_bytes", "serve_max_json_depth",
                     "serve_read_timeout", "serve_body_timeout", "serve_chat_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.batch_max_bad_share <= 1:
            raise ValueError(f"batch_max_bad_share must be between 0 and 1, got {self.batch_max_bad_share}")
        if not self.broker_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"broker_url must be a redis:// URL, got {self.broker_url!r}")
        if not self.storage_url.startswith(("s3://", "file://")):
            raise ValueError(f"storage_url must be s3://bucket/prefix or file:///dir, got {self.storage_url!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        kind, sep, path = self.speculative.partition(":")
        if self.speculative not in ("", "none") and (kind not in ("ngram", "draft", "head")
                                                     or (kind == "draft") != bool(sep and path)):
            raise ValueError(f"speculative must be ngram, draft:<path>, head or none, got {self.speculative!r}")
        if min(self.shutdown_grace, self.storage_retry, self.retention, self.orphan_grace) < 0:
            raise ValueError("shutdown_grace, storage_retry, retention and orphan_grace must not be negative")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a TCP port (0 = off), got {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        self._check_kv()
        self.queue_depth_limit("xs")  # validates the format
        self._check_webhooks()
        if self.tenant:
            try:
                check_tenant(self.tenant)
            except ValueError as e:
                raise ValueError(f"tenant (VLMQ_TENANT): {e}") from None

    def _check_kv(self) -> None:
        if min(self.kv_archive_bytes, self.kv_host_bytes, self.kv_disk_bytes) < 0 or self.kv_archive not in (0, 1):
            raise ValueError("kv_archive is 0 or 1; kv_archive_bytes, kv_host_bytes and kv_disk_bytes are >= 0")
        if self.kv_archive_key and len(self.kv_archive_key) < MIN_ARCHIVE_KEY_CHARS:
            raise ValueError(f"kv_archive_key (VLMQ_KV_ARCHIVE_KEY) must have at least {MIN_ARCHIVE_KEY_CHARS} "
                             "characters, e.g. from `openssl rand -hex 32`")
        self.kv_quant("")  # validates the format

    def _check_webhooks(self) -> None:
        from vlmq.webhook_guard import parse_networks

        if self.webhook_timeout <= 0 or self.webhook_poll <= 0 or self.webhook_concurrency <= 0:
            raise ValueError("webhook_timeout, webhook_poll and webhook_concurrency must be positive")
        if self.webhook_inline_max < 0:
            raise ValueError("webhook_inline_max must not be negative")
        if self.image_fetch_timeout <= 0 or self.image_fetch_redirects < 0 or self.image_fetch_retries < 0:
            raise ValueError("image_fetch_timeout must be positive, image_fetch_redirects and image_fetch_retries "
                             "not negative")
        for name, check in (("webhook_retry_schedule", parse_delays), ("webhook_allow", parse_networks),
                            ("image_fetch_networks", parse_networks)):
            try:
                check(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name} ({env_name(name)}): {e}") from None

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

    def kv_quant(self, model: str) -> str:
        """The KV archive encoding for one model: "" (lossless), "int8" or "fp8"."""
        raw = self.kv_archive_quant.strip()
        per_model = dict(part.split("=", 1) for part in raw.split(",")) if "=" in raw else {model: raw}
        quant = per_model.get(model, "").strip()
        if any(q.strip() not in ("", "int8", "fp8") for q in per_model.values()):
            raise ValueError(f"kv_archive_quant must be int8, fp8 or name=int8,name2=fp8; got {raw!r}")
        return quant

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``VLMQ_*`` variables (an unset or empty one keeps its default); keyword overrides win.

        Raises:
            ValueError: a variable does not parse (the message names it).
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            var, fallback = env_name(f.name), f.metadata["fallback"]
            raw = env.get(var) or (env.get(fallback) if fallback else None)
            if not raw:
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as e:
                raise ValueError(f"{var}={raw!r}: {e}") from e
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The ``VLMQ_*`` variables that reproduce these settings in a child process."""
        return {env_name(f.name): f.metadata["to_text"](getattr(self, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def env_name(field_name: str) -> str:
    """The environment variable of a setting."""
    return f"VLMQ_{field_name.upper()}"


def _shown_default(f: dataclasses.Field[Any]) -> str:
    if f.metadata["shown"]:
        return str(f.metadata["shown"])
    return f"`{f.default}`"


def markdown_table(readers: Sequence[str] = tuple(READERS)) -> str:
    """Configuration tables, one per reader (producers and workers, producers, workers), for ``readers``."""
    parts = []
    for reader in readers:
        rows = [f"| `{env_name(f.name)}` | {_shown_default(f)} | {f.metadata['meaning']} |"
                for f in dataclasses.fields(Settings) if f.metadata["reader"] == reader]
        parts.append("\n".join([f"{READERS[reader]}:", "", "| variable | default | meaning |", "|---|---|---|", *rows]))
    return "\n\n".join(parts) + "\n"


ENV_VARS: dict[str, str] = {env_name(f.name): f.metadata["meaning"] for f in dataclasses.fields(Settings)}


def readme_table(text: str, begin: str = README_BEGIN) -> str:
    """The generated part of a document (between ``begin`` and the end marker)."""
    start = text.index(begin) + len(begin)
    return text[start:text.index(README_END, start)].lstrip("\n")


def update_readme(path: Path, begin: str = README_BEGIN, readers: Sequence[str] = README_READERS) -> bool:
    """Rewrite the table between the markers in ``path``; returns whether it changed."""
    text = path.read_text()
    start = text.index(begin) + len(begin)
    end = text.index(README_END, start)
    new = f"{text[:start]}\n{markdown_table(readers)}{text[end:]}"
    if new != text:
        path.write_text(new)
    return new != text


def update_docs(path: Path) -> bool:
    """Rewrite the worker settings' table in ``path`` (docs/configuration.md); returns whether it changed."""
    return update_readme(path, DOCS_BEGIN, DOCS_READERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmq.settings", description="The VLMQ_* settings tables.")
    parser.add_argument("--markdown", action="store_true", help="print every configuration table")
    parser.add_argument("--update-readme", type=Path, metavar="README", help="rewrite the producers' tables in it")
    parser.add_argument("--update-docs", type=Path, metavar="CONFIGURATION",
                        help="rewrite the workers' table in it (docs/configuration.md)")
    args = parser.parse_args(argv)
    for path, update in ((args.update_readme, update_readme), (args.update_docs, update_docs)):
        if path:
            print(f"{path}: " + ("updated" if update(path) else "already up to date"))
    if not (args.update_readme or args.update_docs):
        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
