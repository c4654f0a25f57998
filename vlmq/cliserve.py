"""``vlmq serve``: the OpenAI API over HTTP in front of the pool (``vlmq.serve``).

Usage: ``vlmq serve --host 0.0.0.0 --port 8000 [--workers N]``; configured by ``VLMQ_*`` like every producer.
"""
from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        print("error: vlmq serve needs the serve extra: pip install 'vlmq[serve]'", file=sys.stderr)
        return 2
    uvicorn.run("vlmq.serve.app:from_env", factory=True, host=args.host, port=args.port, workers=args.workers,
                timeout_keep_alive=5, log_level=args.log_level, access_log=False)
    return 0


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``serve`` command."""
    p = sub.add_parser("serve", help="serve the OpenAI API (Files, Batches, Chat Completions) in front of the pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="processes (each stateless: any number, any replica)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)
