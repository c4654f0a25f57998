"""Human output of the ``vlmq`` command (``--json`` prints the records themselves)."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# record fields shown as times, and the ones shown as numbers
_TIMES = ("created_at", "queued_at", "started_at", "finished_at", "failed_at", "canceled_at")
_SHOWN = ("model", "cost_class", "vision_tokens", "image_count", "priority", "max_new_tokens", "worker", "attempts",
          "generated_tokens", "custom_id", "batch_id")


def when(epoch: float | str | None, now: float | None = None) -> str:
    """``2026-12-01 15:26:31 (3 s ago)`` in local time; ``-`` for no time."""
    if epoch in (None, ""):
        return "-"
    seconds = float(epoch)
    stamp = datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")
    ago = (time.time() if now is None else now) - seconds
    return f"{stamp} ({duration(ago)} ago)" if ago >= 0 else f"{stamp} (in {duration(-ago)})"


def duration(seconds: float) -> str:
    """``850 ms``, ``12.3 s``, ``4 min 5 s``, ``3 h 2 min``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def job_lines(record: Mapping[str, str]) -> list[str]:
    """A job record, readable: status, error, the fields users ask about, and times."""
    lines = [f"job {record.get('id', '?')}: {record.get('status', '?')}"]
    if record.get("error_type"):
        lines.append(f"  error: {record['error_type']}: {record.get('error_message', '')}")
    lines += [f"  {name}: {record[name]}" for name in _SHOWN if record.get(name)]
    lines += [f"  {name[:-3]}: {when(record[name])}" for name in _TIMES if record.get(name)]
    return lines


def result_lines(doc: Mapping[str, Any]) -> list[str]:
    """A result document, readable: the answer, then one line each of usage and timings."""
    usage, timings = doc.get("usage", {}), doc.get("timings", {})
    return [doc.get("text", ""), "",
            f"job {doc.get('job_id')}: {doc.get('finish_reason')}, {usage.get('generated_tokens')} tokens "
            f"({usage.get('image_tokens')} image + {usage.get('prompt_tokens')} prompt), worker {doc.get('worker')}",
            "timings: " + ", ".join(f"{k} {duration(float(v))}" for k, v in timings.items()),
            f"token ids: {json.dumps(doc.get('token_ids', []))}"]


def batch_lines(batch: Mapping[str, Any]) -> list[str]:
    """A batch object, readable."""
    c = batch["request_counts"]
    lines = [f"batch {batch['id']}: {batch['status']}",
             f"  requests: {c['total']} total, {c['completed']} completed, {c['failed']} failed"
             + (f" ({c['cancelled']} cancelled)" if c.get("cancelled") else "")
             + (f"; {c['rejected']} line(s) refused at submit (in the error file)" if c.get("rejected") else "")]
    for name in ("input_file_id", "output_file_id", "error_file_id"):
        if batch.get(name):
            lines.append(f"  {name[:-3].replace('_', ' ')}: {batch[name]}")
    for name in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "cancelled_at", "expired_at",
                 "failed_at", "expires_at"):
        if batch.get(name):
            lines.append(f"  {name[:-3].replace('_', ' ')}: {when(batch[name])}")
    for error in ((batch.get("errors") or {}).get("data") or [])[:20]:
        lines.append(f"  line {error['line']}: {error['code']}: {error['message']}")
    return lines


def size(num_bytes: float) -> str:
    """``512 B``, ``40.7 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _rates(rates: Mapping[str, float | None]) -> str:
    return ", ".join(f"{tier.replace('_', ' ')} {'-' if r is None else f'{r:.0%}'}" for tier, r in rates.items())


def cache_lines(stats: Mapping[str, Any]) -> list[str]:
    """``Client.cache_stats()``, readable: the archive per model, hit rates per model and per worker."""
    from vlmq.cachestats import hit_rates

    lines = ["archive (kv/ in the pool's storage):"]
    lines += [f"  {entry.get('model') or '(no live worker names it)'} [{model_hash[:12]}]: {entry['objects']} "
              f"objects, {size(entry['bytes'])}" for model_hash, entry in stats["archive"].items()] or ["  empty"]
    for model, entry in stats["models"].items():
        c = entry["counters"]
        lines += [f"model {model}: {c.get('workers', 0)} worker(s), {c.get('jobs_served', 0)} jobs served, "
                  f"{c.get('encoded_images', 0)} images encoded, {c.get('hot_inputs', 0)} hot inputs",
                  f"  hit rates: {_rates(entry['hit_rates'])}"]
    for name, fields in stats["workers"].items():
        lines.append(f"worker {name} ({fields.get('model', '?')}, classes {fields.get('classes', '-')}): "
                     f"{fields.get('jobs_served', 0)} jobs; {_rates(hit_rates(fields))}")
    return lines


def emit(value: Any, as_json: bool, lines: list[str] | None = None) -> None:
    """Print ``value`` as JSON, or the human ``lines``."""
    if as_json:
        json.dump(value, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n".join(lines or []))
