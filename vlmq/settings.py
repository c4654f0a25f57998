"""Settings: the only module that reads ``VLMQ_*`` environment variables.

Each setting is declared once, as a field of ``Settings``: its name (``VLMQ_`` + the field name in
capitals), type, default, who reads it (producers, workers, or both) and a one-line meaning.
``Settings.from_env``, ``Settings.to_env`` and the README's configuration table all come from
these declarations; ``python -m vlmq.settings --markdown`` prints the table and
``python -m vlmq.settings --update-readme README.md`` rewrites it in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmq.keys import check_tenant

BACKENDS = ("engine", "hf")  # worker backends; the first is the default
DEFAULT_COST_CLASSES = "xs=256,s=1024,m=4096,l=16384,xl"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STORAGE_URL = "file:///tmp/vlmq"

BOTH, PRODUCER, WORKER = "both", "producer", "worker"
READERS = {BOTH: "Read by producers and workers", PRODUCER: "Read by producers (the SDK)",
           WORKER: "Read by workers"}
README_BEGIN = "<!-- settings-table:begin (generated: python -m vlmq.settings --update-readme README.md) -->"
README_END = "<!-- settings-table:end -->"


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
                                     "class cost, enforced by workers")
    max_new_tokens: int = _setting(1024, BOTH, "largest `max_new_tokens` a job may ask for (workers re-check it)")
    max_prompt_chars: int = _setting(8000, BOTH, "longest prompt accepted, in characters (workers re-check it)")
    max_image_bytes: int = _setting(20 * 1024 * 1024, BOTH, "largest image accepted, in bytes",
                                    shown="20 MiB")
    max_image_pixels: int = _setting(40_000_000, BOTH, "largest declared image size, in pixels",
                                     shown="40,000,000")
    job_ttl: int = _setting(7 * 24 * 3600, BOTH, "seconds a job record, cancel flag and idempotency key are "
                            "kept: from submit, and a record again from the job's end",
                            shown="604800 (7 days)")
    # -- read by producers (the SDK) -----------------------------------------------------------
    max_queue_depth: str = _setting("0", PRODUCER, "waiting jobs allowed per class, `N` or `xs=N,s=M`; a submit "
                                    "that would pass it raises `QueueFull`", shown="`0` (no limit)")
    tenant: str = _setting("", PRODUCER, "tenant id (`[a-z0-9-]`, at most 32): scopes this producer's job ids, "
                           "keys and storage prefix (see docs/security.md)", shown="none (untenanted)")
    # -- read by workers -----------------------------------------------------------------------
    visibility_timeout: int = _setting(300, WORKER, "seconds before a dead worker's messages are delivered "
                                       "again (live workers renew theirs)")
    max_attempts: int = _setting(3, WORKER, "deliveries that crashed or timed out before a job fails as `poison`")
    shutdown_grace: int = _setting(30, WORKER, "seconds SIGTERM waits for running jobs before handing them back")
    storage_retry: int = _setting(300, WORKER, "seconds to retry an unreachable object store before handing a "
                                  "job back")
    worker_budget: int = _setting(32768, WORKER, "sum of class cost bounds it may hold at once, in tokens")
    worker_batch: int = _setting(16, WORKER, "most jobs it holds at once")
    worker_classes: str = _setting("", WORKER, "cost classes it consumes, e.g. `xs,s`",
                                   shown="all that fit its budget")
    backend: str = _setting(BACKENDS[0], WORKER, "`engine` (the vlmq engine) or `hf` (plain transformers "
                            "`generate`)")
    device: str = _setting("cpu", WORKER, "`cpu`, `cuda` or `cuda:N`")
    speculative: str = _setting("", WORKER, "speculative decoding in the engine backend: `ngram`, `draft:<path>` "
                                "(a small text LM with the model's tokenizer; relative to the model folder) or "
                                "`head` (the model folder's `spec-head`)", shown="off")

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
        kind, sep, path = self.speculative.partition(":")
        if self.speculative and (kind not in ("ngram", "draft", "head") or (kind == "draft") != bool(sep and path)):
            raise ValueError(f"speculative must be ngram, draft:<path> or head, got {self.speculative!r}")
        if self.shutdown_grace < 0 or self.storage_retry < 0:
            raise ValueError("shutdown_grace and storage_retry must not be negative")
        self.queue_depth_limit("xs")  # validates the format
        if self.tenant:
            try:
                check_tenant(self.tenant)
            except ValueError as e:
                raise ValueError(f"tenant (VLMQ_TENANT): {e}") from None

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


def markdown_table() -> str:
    """The README's configuration tables, one per reader (producers and workers, producers, workers)."""
    parts = []
    for reader, title in READERS.items():
        rows = [f"| `{env_name(f.name)}` | {_shown_default(f)} | {f.metadata['meaning']} |"
                for f in dataclasses.fields(Settings) if f.metadata["reader"] == reader]
        parts.append("\n".join([f"{title}:", "", "| variable | default | meaning |", "|---|---|---|", *rows]))
    return "\n\n".join(parts) + "\n"


ENV_VARS: dict[str, str] = {env_name(f.name): f.metadata["meaning"] for f in dataclasses.fields(Settings)}


def readme_table(text: str) -> str:
    """The generated part of a README (between the settings-table markers)."""
    return text[text.index(README_BEGIN) + len(README_BEGIN):text.index(README_END)].lstrip("\n")


def update_readme(path: Path) -> bool:
    """Rewrite the table between the markers in ``path``; returns whether it changed."""
    text = path.read_text()
    start, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    new = f"{text[:start]}\n{markdown_table()}{text[end:]}"
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmq.settings", description="The VLMQ_* settings table.")
    parser.add_argument("--markdown", action="store_true", help="print the README's configuration tables")
    parser.add_argument("--update-readme", type=Path, metavar="README", help="rewrite the tables in this file")
    args = parser.parse_args(argv)
    if args.update_readme:
        print("updated" if update_readme(args.update_readme) else "already up to date")
    else:
        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
