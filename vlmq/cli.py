"""The ``vlmq`` command: demo, up, worker, delivery, top, cost, submit, status, result, wait, cancel, batch, acl,
cache.

Read commands print readable text by default and the records themselves with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmq.cliformat import cache_lines, emit, job_lines, result_lines
from vlmq.errors import InvalidRequest, JobFailed, JobNotFound, JobTimeout, VlmqError

EPILOG = """environment:
  VLMQ_BROKER_URL   Redis URL of the pool (default redis://127.0.0.1:6379/0); --broker overrides it
  VLMQ_STORAGE_URL  s3://bucket/prefix or file:///dir (default file:///tmp/vlmq); --storage overrides it
  Producers and workers must share both. Every VLMQ_* setting: python -m vlmq.settings --markdown
"""


def _cost(args: argparse.Namespace) -> int:
    from vlmq.cost import REPORT_COLUMNS, cost_report, report_rows
    from vlmq.models import cost_classes, resolve_model
    from vlmq.settings import Settings

    settings = Settings.from_env()
    spec = resolve_model(args.model, settings)
    rows = report_rows(args.images, spec.policy, cost_classes(settings))
    if args.json:
        emit([dict(zip(REPORT_COLUMNS, row, strict=True)) for row in rows], True)
    else:
        print(cost_report(args.images, spec.policy, cost_classes(settings)), end="")
    refused = [row[0] for row in rows if row[-1].startswith("error:")]
    if refused:
        print(f"error: {len(refused)} file(s) refused: {', '.join(refused)}", file=sys.stderr)
    return 1 if refused else 0


def _client(args: argparse.Namespace) -> Any:
    """A client from the environment, with ``--broker``/``--storage`` overriding it."""
    from vlmq.client import Client
    from vlmq.settings import Settings

    overrides = {k: v for k, v in (("broker_url", getattr(args, "broker", None)),
                                   ("storage_url", getattr(args, "storage", None))) if v}
    return Client(settings=Settings.from_env(**overrides))


def _worker(args: argparse.Namespace) -> int:
    try:
        from vlmq.workers.main import main_from_args  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        print(f"vlmq worker needs the worker extra (pip install 'vlmq[worker]'): {e}", file=sys.stderr)
        return 2
    return int(main_from_args(args))


def _delivery(args: argparse.Namespace) -> int:
    from vlmq.delivery import main_from_args

    return main_from_args(args)


def _demo(args: argparse.Namespace) -> int:
    from vlmq.demo import run_demo

    return run_demo(num_jobs=args.jobs, keep=args.keep)


def _up(args: argparse.Namespace) -> int:
    from vlmq.up import UpOptions, run_up

    try:
        options = UpOptions(workers=args.workers, gpus=args.gpus, model=args.model, folder=args.folder, port=args.port,
                            serve=args.serve)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_up(options)


def _top(args: argparse.Namespace) -> int:
    from vlmq.fleet import run_top
    from vlmq.settings import Settings

    return run_top(Settings.from_env(), args.interval, args.once)


def _submit(args: argparse.Namespace) -> int:
    messages = _messages(args.messages) if args.messages else None
    if (messages is None) != (args.prompt is not None):
        raise InvalidRequest("give an image and a prompt, or --messages alone", code="missing_field")
    with _client(args) as client:
        job = client.submit(args.image, args.prompt, messages=messages, model=args.model,
                            max_new_tokens=args.max_new_tokens,
                            priority=args.priority, idempotency_key=args.idempotency_key, webhook=args.webhook,
                            temperature=args.temperature, seed=args.seed, decoding=_decoding(args))
        if not args.wait:
            emit({"id": job.id}, args.json, [job.id])
            return 0
        result = job.result(timeout=args.timeout)
        emit(result.raw, args.json, result_lines(result.raw))
    return 0


def _decoding(args: argparse.Namespace) -> dict[str, Any]:
    """--decoding's JSON object, with each --stop added to its stop strings."""
    try:
        decoding = json.loads(args.decoding) if args.decoding else {}
    except ValueError as e:
        raise InvalidRequest(f"--decoding is not JSON: {e}", code="bad_decoding") from None
    if not isinstance(decoding, dict):
        raise InvalidRequest("--decoding must be a JSON object", code="bad_decoding")
    if args.stop:
        given = decoding.get("stop") or []
        decoding["stop"] = ([given] if isinstance(given, str) else list(given)) + args.stop
    return decoding


def _messages(source: str) -> Any:
    """The ``--messages`` JSON: a file, ``-`` for stdin, or the JSON text itself."""
    text = sys.stdin.read() if source == "-" else source if source.lstrip().startswith("[") else \
        Path(source).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"--messages is not JSON: {e}", code="bad_messages") from None


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        records = [client.job(job_id).info() for job_id in args.job_ids]
        emit(records if len(records) > 1 else records[0], args.json, [x for r in records for x in job_lines(r)])
    return 0


def _result(args: argparse.Namespace) -> int:
    with _client(args) as client:
        raw = client.job(args.job_id).result(timeout=args.timeout).raw
        emit(raw, args.json, result_lines(raw))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    outcomes = {}
    with _client(args) as client:
        for job_id in args.job_ids:
            try:
                outcomes[job_id] = "canceled" if client.job(job_id).cancel() else "already ended"
            except JobNotFound:
                outcomes[job_id] = "not found"
    emit(outcomes, args.json, [f"{job_id}: {what}" for job_id, what in outcomes.items()])
    return 1 if "not found" in outcomes.values() else 0


def _wait(args: argparse.Namespace) -> int:
    """Wait for every job; exit 0 if all finished, 1 if any failed or was canceled, 124 on timeout."""
    import time

    deadline = time.monotonic() + args.timeout
    outcomes: dict[str, dict[str, str]] = {}
    with _client(args) as client:
        for job_id in args.job_ids:
            job = client.job(job_id)
            try:
                job.result(timeout=max(0.0, deadline - time.monotonic()))
                outcomes[job_id] = {"status": "finished"}
            except JobFailed as e:
                outcomes[job_id] = {"status": job.status().value, "error": f"{e.error_type}: {e.message}"}
            except JobTimeout:
                outcomes[job_id] = {"status": job.status().value, "error": f"timeout after {args.timeout:g} s"}
    emit(outcomes, args.json, [f"{j}: {o['status']}" + (f" ({o['error']})" if "error" in o else "")
                               for j, o in outcomes.items()])
    if any(o["status"] not in ("finished", "failed", "canceled") for o in outcomes.values()):
        return 124
    return 0 if all(o["status"] == "finished" for o in outcomes.values()) else 1


def _acl(args: argparse.Namespace) -> int:
    from vlmq.acl import describe, new_password
    from vlmq.settings import Settings

    try:
        text = describe(args.tenant, args.password or new_password(), acl_file=args.acl_file,
                        storage_url=Settings.from_env().storage_url)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _cache(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "stats":
            stats = client.cache_stats()
            emit(stats, args.json, cache_lines(stats))
            return 0
        if not args.model:
            print("error: vlmq cache purge needs --model NAME (or a model hash from vlmq cache stats)",
                  file=sys.stderr)
            return 2
        objects, size = client.purge_cache(args.model)
        print(f"deleted {objects} archived objects ({size} bytes) of {args.model}")
    return 0


def _add_cache(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cache", parents=[common], help="the fleet's caches: archive size and hit rates (stats), "
                       "delete an archive (purge --model M)")
    p.add_argument("action", choices=["stats", "purge"])
    p.add_argument("--model", help="purge: the model name, or a model hash as stats shows it")
    p.set_defaults(func=_cache)


def _add_acl(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("acl", help="print the Redis ACL user of a tenant or of the workers (docs/security.md)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", help="a tenant id: its producers' user (and its object-store policy for s3://)")
    who.add_argument("--worker", action="store_true", help="the workers' user")
    p.add_argument("--password", help="the user's password (default: a new random one, printed in the command)")
    p.add_argument("--acl-file", action="store_true", help="print an ACL file line instead of an ACL SETUSER command")
    p.set_defaults(func=_acl)


def _common() -> argparse.ArgumentParser:
    """Options every command that reaches the pool takes (before or after the command name)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--broker", default=argparse.SUPPRESS, metavar="URL",
                        help="Redis URL of the pool (default: VLMQ_BROKER_URL)")
    common.add_argument("--storage", default=argparse.SUPPRESS, metavar="URL",
                        help="s3://bucket/prefix or file:///dir (default: VLMQ_STORAGE_URL)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON records instead of text")
    return common


def _add_jobs(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("submit", parents=[common], help="submit one job (prints its id, or the result with --wait)")
    p.add_argument("image", nargs="?")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--messages", metavar="JSON", help="the job as OpenAI chat messages instead of image and prompt: "
                   "a JSON file, - for stdin, or the JSON list itself (image_url: data: URL, path or s3:// URI)")
    p.add_argument("--model", default="tiny-shapes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--priority", type=int, default=5)
    p.add_argument("--idempotency-key")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; up to 2 samples")
    p.add_argument("--seed", type=int, help="with --temperature: the same seed gives the same answer")
    p.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (up to 4): the answer ends before it")
    p.add_argument("--decoding", metavar="JSON", help='more decoding controls, e.g. \'{"top_p": 0.9, "logprobs": '
                   'true, "top_logprobs": 3}\' (vlmq.decoding)')
    p.add_argument("--webhook", help="http(s) URL told when the job ends (default VLMQ_WEBHOOK_URL)")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=_submit)
    p = sub.add_parser("status", parents=[common], help="print jobs' records")
    p.add_argument("job_ids", nargs="+", metavar="ID")
    p.set_defaults(func=_status)
    p = sub.add_parser("result", parents=[common], help="wait for a job and print its result")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=_result)
    p = sub.add_parser("wait", parents=[common],
                       help="wait for jobs; exit 0 if all finished, 1 if any failed or was canceled, 124 on timeout")
    p.add_argument("job_ids", nargs="+", metavar="ID")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for all of them (default 600)")
    p.set_defaults(func=_wait)
    p = sub.add_parser("cancel", parents=[common], help="cancel jobs (queued ones never run)")
    p.add_argument("job_ids", nargs="+", metavar="ID")
    p.set_defaults(func=_cancel)


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a local pool (Valkey, file storage, workers) until Ctrl-C, for producers "
                       "in other shells")
    p.add_argument("--workers", type=int, default=1, help="CPU worker processes (default 1)")
    p.add_argument("--gpus", help="'all' or a list like 0,1: one worker per GPU instead of CPU workers")
    p.add_argument("--model", default="tiny-shapes")
    p.add_argument("--folder", help="keep storage and worker logs here (default: a temporary folder, removed)")
    p.add_argument("--port", type=int, help="Valkey's port (default: a free one)")
    p.add_argument("--serve", type=int, metavar="PORT", help="also run vlmq serve (the OpenAI API) on PORT and print "
                   "OPENAI_BASE_URL and OPENAI_API_KEY (needs the serve extra)")
    p.set_defaults(func=_up)


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="a live view of the pool: queue depths per class, workers, throughput")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.set_defaults(func=_top)


def build_parser() -> argparse.ArgumentParser:
    from vlmq.clibatch import add_batch

    common = _common()
    parser = argparse.ArgumentParser(prog="vlmq", description="Serve vision-language models from a queue.",
                                     parents=[common], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the whole pool on this machine and caption sample images")
    p.add_argument("--jobs", type=int, default=16, help="number of jobs to submit (default 16)")
    p.add_argument("--keep", action="store_true", help="keep the storage folder afterwards")
    p.set_defaults(func=_demo)
    _add_up(sub)
    p = sub.add_parser("worker", help="run a worker (one process per GPU with --gpus)")
    from vlmq.worker_args import add_delivery_arguments, add_worker_arguments

    add_worker_arguments(p)
    p.set_defaults(func=_worker)
    p = sub.add_parser("delivery", help="run a webhook delivery worker (CPU only; needs VLMQ_WEBHOOK_SECRETS)")
    add_delivery_arguments(p)
    p.set_defaults(func=_delivery)
    _add_top(sub)
    p = sub.add_parser("cost", parents=[common], help="print the vision-token cost of images from their headers "
                       "(exit 1 if any is refused)")
    p.add_argument("images", nargs="+")
    p.add_argument("--model", default="tiny-shapes")
    p.set_defaults(func=_cost)
    _add_jobs(sub, common)
    add_batch(sub, common, _client)
    _add_acl(sub)
    _add_cache(sub, common)
    from vlmq.clikeys import add_keys
    from vlmq.cliserve import add_serve

    add_keys(sub, common)
    add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except VlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
