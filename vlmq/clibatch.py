"""``vlmq batch submit|status|wait|download|cancel``: batch files in the OpenAI Batch format."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmq.cliformat import batch_lines, emit
from vlmq.progress import Progress

ClientFactory = Callable[[argparse.Namespace], Any]
SHOWN_REFUSED = 10  # refused lines printed by ``batch submit``


def _ended_well(batch: dict[str, Any]) -> bool:
    return bool(batch["status"] == "completed" and batch["request_counts"]["failed"] == 0)


def _submit(args: argparse.Namespace, client_of: ClientFactory) -> int:
    with client_of(args) as client:
        batch = client.submit_batch(args.file, completion_window=args.completion_window, priority=args.priority,
                                    max_new_tokens=args.max_tokens, webhook=args.webhook,
                                    allow_outside_paths=args.allow_outside_paths)
        obj = batch.refresh()
        if obj["request_counts"].get("rejected"):
            _report_refused(batch, obj["request_counts"])
        if args.wait:
            return _follow(batch, args)
        emit(obj, args.json, [batch.id] if not args.json else None)
    return 0


def _report_refused(batch: Any, counts: dict[str, int]) -> None:
    """On stderr: how many lines were refused at submit, and the first few (all are in the error file)."""
    print(f"{counts['rejected']} of {counts['total']} line(s) refused (the rest run; each is in the error file):",
          file=sys.stderr)
    for entry in batch.rejected()[:SHOWN_REFUSED]:
        error = entry["response"]["body"]["error"]
        print(f"  line {error['line']}: {error['code']}: {error['message']}", file=sys.stderr)
    if counts["rejected"] > SHOWN_REFUSED:
        print(f"  ... and {counts['rejected'] - SHOWN_REFUSED} more", file=sys.stderr)


def _status(args: argparse.Namespace, client_of: ClientFactory, cancel: bool = False) -> int:
    with client_of(args) as client:
        handle = client.batch(args.batch_id)
        batch = handle.cancel() if cancel else handle.refresh()
        emit(batch, args.json, batch_lines(batch))
    return 0


def _follow(batch: Any, args: argparse.Namespace) -> int:
    """Wait with progress on stderr (a bar on a terminal, a line every few seconds elsewhere); exit 1 unless
    every request completed."""
    progress = Progress("requests", sys.stderr, label=f"{batch.id} ")

    def report(obj: dict[str, Any]) -> None:
        c = obj["request_counts"]
        if not args.json:
            progress.update(c["completed"] + c["failed"], c["total"], f"{obj['status']}, {c['failed']} failed")

    try:
        obj = batch.wait(timeout=args.timeout, on_progress=report)
    finally:
        progress.close()
    emit(obj, args.json, batch_lines(obj))
    return 0 if _ended_well(obj) else 1


def _wait(args: argparse.Namespace, client_of: ClientFactory) -> int:
    with client_of(args) as client:
        return _follow(client.batch(args.batch_id), args)


def _download(args: argparse.Namespace, client_of: ClientFactory) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with client_of(args) as client:
        batch = client.batch(args.batch_id)
        for which, name in (("output", "output.jsonl"), ("error", "errors.jsonl")):
            path = out_dir / f"{batch.id}_{name}"
            data = batch.download(which)
            path.write_bytes(data)
            lines = data.count(b"\n")
            print(f"{path} ({lines} lines)")
    return 0


def _cancel(args: argparse.Namespace, client_of: ClientFactory) -> int:
    return _status(args, client_of, cancel=True)


def add_batch(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser,
              client_of: ClientFactory) -> None:
    """The ``batch`` command group."""
    group = sub.add_parser("batch", parents=[common], help="batch files in the OpenAI Batch format (JSONL)",
                           description="Submit and follow batch files: one /v1/chat/completions request per line; "
                                       "output and error files in OpenAI's format.")
    commands = group.add_subparsers(dest="batch_command", required=True)
    p = commands.add_parser("submit", parents=[common],
                            help="check every line, then enqueue the good ones (bad lines go to the error file "
                                 "unless more than VLMQ_BATCH_MAX_BAD_SHARE are bad)")
    p.add_argument("file")
    p.add_argument("--completion-window", default="24h", help="e.g. 24h, 90m (default 24h)")
    p.add_argument("--priority", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128, help="for lines without max_tokens (default 128)")
    p.add_argument("--webhook", help="http(s) URL sent batch.completed when it ends (default VLMQ_WEBHOOK_URL)")
    p.add_argument("--allow-outside-paths", action="store_true",
                   help="let image paths lead outside the batch file's folder (only for a batch file you trust)")
    p.add_argument("--wait", action="store_true", help="follow it to the end (exit 1 if any request failed)")
    p.add_argument("--timeout", type=float, default=None)
    p.set_defaults(func=lambda a: _submit(a, client_of))
    for name, func, text in (("status", _status, "print a batch"),
                             ("wait", _wait, "follow a batch with a progress bar; exit 1 if any request failed"),
                             ("download", _download, "write a batch's output and error files"),
                             ("cancel", _cancel, "cancel a batch (queued requests never run)")):
        p = commands.add_parser(name, parents=[common], help=text)
        p.add_argument("batch_id")
        if name == "wait":
            p.add_argument("--timeout", type=float, default=None, help="seconds (default: no limit)")
        if name == "download":
            p.add_argument("--output-dir", default=".", help="folder for <id>_output.jsonl and <id>_errors.jsonl")
        p.set_defaults(func=lambda a, f=func: f(a, client_of))
