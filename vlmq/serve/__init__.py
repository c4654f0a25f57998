"""``vlmq serve``: the OpenAI API (Files, Batches, Chat Completions, Models) over HTTP, in front of the pool.

Usage: ``vlmq serve --port 8000`` (``vlmq keys create --tenant acme`` for a key), then the official client::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="vlmq-...")

Why Starlette on uvicorn: the door is a thin translation of HTTP into ``vlmq.Client`` calls, so it wants a small,
well-kept ASGI toolkit with a streaming multipart parser (uploads spool to disk, never whole in memory) and
nothing else; FastAPI would add a pydantic model layer we do not need (the request shapes are checked by the same
code as the SDK's: ``vlmq.batchfile``, ``vlmq.chat``, ``vlmq.decoding``), aiohttp its own server.

The process holds no state of its own: keys, batches and jobs are in the pool's Redis, Files in its object
store, so replicas run behind any load balancer. It never imports torch. What each module holds: ``app`` (routes
and assembly), ``door`` (keys -> tenants -> clients), ``guard`` (body limits, slow clients, metrics), ``errors``
(OpenAI's error shape), ``routes_files``, ``routes_batches``, ``routes_chat``.
"""
from __future__ import annotations
