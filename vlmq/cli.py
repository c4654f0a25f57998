"""The ``vlmq`` command: demo, up, worker, delivery, top, cost, submit, status, result, acl, cache."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from vlmq.errors import VlmqError


def _cost(args: argparse.Namespace) -> int:
    from vlmq.cost import cost_report
    from vlmq.models import cost_classes, resolve_model
    from vlmq.settings import Settings

    settings = Settings.from_env()
    spec = resolve_model(args.model, settings)
    print(cost_report(args.images, spec.policy, cost_classes(settings)))
    return 0


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
        options = UpOptions(workers=args.workers, gpus=args.gpus, model=args.model, folder=args.folder, port=args.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_up(options)


def _top(args: argparse.Namespace) -> int:
    from vlmq.fleet import run_top
    from vlmq.settings import Settings

    return run_top(Settings.from_env(), args.interval, args.once)


def _submit(args: argparse.Namespace) -> int:
    from vlmq.client import Client

    with Client.from_env() as client:
        job = client.submit(args.image, args.prompt, model=args.model, max_new_tokens=args.max_new_tokens,
                            priority=args.priority, idempotency_key=args.idempotency_key, webhook=args.webhook)
        if not args.wait:
            print(job.id)
            return 0
        result = job.result(timeout=args.timeout)
        print(json.dumps(result.raw, indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    from vlmq.client import Client

    with Client.from_env() as client:
        print(json.dumps(client.job(args.job_id).info(), indent=2))
    return 0


def _result(args: argparse.Namespace) -> int:
    from vlmq.client import Client

    with Client.from_env() as client:
        print(json.dumps(client.job(args.job_id).result(timeout=args.timeout).raw, indent=2))
    return 0


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
    from vlmq.client import Client

    with Client.from_env() as client:
        if args.action == "stats":
            print(json.dumps(client.cache_stats(), indent=2, sort_keys=True))
            return 0
        if not args.model:
            print("error: vlmq cache purge needs --model NAME (or a model hash from vlmq cache stats)",
                  file=sys.stderr)
            return 2
        objects, size = client.purge_cache(args.model)
        print(f"deleted {objects} archived objects ({size} bytes) of {args.model}")
    return 0


def _add_cache(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cache", help="the fleet's caches: archive size and hit rates (stats), delete an archive "
                       "(purge --model M)")
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


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a local pool (Valkey, file storage, workers) until Ctrl-C, for producers "
                       "in other shells")
    p.add_argument("--workers", type=int, default=1, help="CPU worker processes (default 1)")
    p.add_argument("--gpus", help="'all' or a list like 0,1: one worker per GPU instead of CPU workers")
    p.add_argument("--model", default="tiny-shapes")
    p.add_argument("--folder", help="keep storage and worker logs here (default: a temporary folder, removed)")
    p.add_argument("--port", type=int, help="Valkey's port (default: a free one)")
    p.set_defaults(func=_up)


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="a live view of the pool: queue depths per class, workers, throughput")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.set_defaults(func=_top)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmq", description="Serve vision-language models from a queue.")
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
    p = sub.add_parser("cost", help="print the vision-token cost of images from their headers")
    p.add_argument("images", nargs="+")
    p.add_argument("--model", default="tiny-shapes")
    p.set_defaults(func=_cost)
    p = sub.add_parser("submit", help="submit one job (prints its id, or the result with --wait)")
    p.add_argument("image")
    p.add_argument("prompt")
    p.add_argument("--model", default="tiny-shapes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--priority", type=int, default=5)
    p.add_argument("--idempotency-key")
    p.add_argument("--webhook", help="http(s) URL told when the job ends (default VLMQ_WEBHOOK_URL)")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=_submit)
    p = sub.add_parser("status", help="print a job's record")
    p.add_argument("job_id")
    p.set_defaults(func=_status)
    p = sub.add_parser("result", help="wait for a job and print its result")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=_result)
    _add_acl(sub)
    _add_cache(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
