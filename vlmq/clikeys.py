"""``vlmq keys create|list|revoke``: the API keys of ``vlmq serve`` (``vlmq.apikeys``), in the pool's Redis.

Usage: ``vlmq keys create --tenant acme --name ci`` prints the new key once; ``vlmq keys list [--tenant acme]``;
``vlmq keys revoke key_1a2b3c4d5e6f``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from vlmq import apikeys
from vlmq.cliformat import emit


def _redis(args: argparse.Namespace) -> Any:
    import redis

    from vlmq.settings import Settings

    url = getattr(args, "broker", None) or Settings.from_env().broker_url
    return redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)


def _keys(args: argparse.Namespace) -> int:
    client = _redis(args)
    try:
        if args.action == "create":
            if not args.tenant:
                print("error: vlmq keys create needs --tenant ID", file=sys.stderr)
                return 2
            key = apikeys.create(client, args.tenant, args.name or "")
            emit({"key": key, "tenant": args.tenant}, args.json,
                 [key, f"# tenant {args.tenant}; shown once: store it now (export OPENAI_API_KEY={key})"])
        elif args.action == "list":
            records = apikeys.list_keys(client, args.tenant)
            emit([asdict(r) for r in records], args.json,
                 [f"{r.id}  tenant={r.tenant}  name={r.name!r}  created_at={r.created_at}" for r in records])
        else:
            if not args.key_id:
                print("error: vlmq keys revoke needs the key's id (key_..., from vlmq keys list)", file=sys.stderr)
                return 2
            if not apikeys.revoke(client, args.key_id):
                print(f"error: no key {args.key_id!r}", file=sys.stderr)
                return 1
            print(f"revoked {args.key_id}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        client.close()
    return 0


def add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """The ``keys`` command."""
    p = sub.add_parser("keys", parents=[common], help="API keys of vlmq serve: create (prints the key once), list, "
                       "revoke KEY_ID")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("key_id", nargs="?", help="revoke: the key's id (key_..., as list shows it)")
    p.add_argument("--tenant", help="create: the tenant the key reaches (required); list: only its keys")
    p.add_argument("--name", help="create: a label for people")
    p.set_defaults(func=_keys)
