"""Atomic pop for kombu's Redis transport: a popped message is never only in a worker's socket.

kombu pops a message with ``BRPOP`` and records it as unacked afterwards (``ZADD``
to ``unacked_index``, ``HSET`` to ``unacked``). A worker killed between the two
loses the message for good: it is in no queue and in no unacked index, so no
visibility-timeout restore brings it back, and its job stays queued forever
(the chaos test caught one). Here a Lua script pops the first message of the
given keys and records it unacked in the same atomic step, with kombu's own
delivery tag and stored form (``[message, exchange, routing_key]``); kombu's
``QoS.append`` then writes the same entries again, harmlessly.

Lua cannot block, so after a pop that found every queue empty the next command
is a short server-side wait (``BLPOP`` on a key nobody writes) and then another
pop: an idle worker sends about ``1 / IDLE_WAIT`` small commands per second and
sees new work within ``IDLE_WAIT`` seconds.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from queue import Empty
from types import MethodType
from typing import Any

IDLE_WAIT = 0.1  # seconds an idle worker waits between pops

# KEYS[1] unacked hash, KEYS[2] unacked index, KEYS[3..] the queue keys in priority order; ARGV[1] now.
POP_SCRIPT = """
for i = 3, #KEYS do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local ok, m = pcall(cjson.decode, item)
    local p = ok and type(m) == 'table' and m['properties']
    local tag = p and p['delivery_tag']
    local info = p and p['delivery_info']
    if type(tag) == 'string' and type(info) == 'table' then
      redis.call('ZADD', KEYS[2], ARGV[1], tag)
      redis.call('HSET', KEYS[1], tag,
        '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    end
    return {KEYS[i], item}
  end
end
return false
"""


def pop_command(channel: Any, queue_keys: Sequence[str]) -> list[Any]:
    """The ``EVAL`` command that pops the first message of ``queue_keys`` and marks it unacked."""
    keys = [channel.unacked_key, channel.unacked_index_key, *queue_keys]
    return ["EVAL", POP_SCRIPT, len(keys), *keys, repr(time.time())]


def install(channel: Any, queue_keys: Any) -> None:
    """Replace the channel's ``BRPOP`` with the atomic pop.

    ``queue_keys(channel)`` returns the keys to pop from, in order, or an empty
    list when nothing may be popped now (the cost gate uses this).
    """
    if channel.global_keyprefix:
        raise RuntimeError("the vlmq atomic pop does not support kombu's global_keyprefix")
    wait_key = f"vlmq:idle-wait:{uuid.uuid4().hex}"  # nobody writes it: BLPOP on it is a server-side sleep
    state = {"idle": False, "sent": ""}
    original_read = channel._brpop_read

    def start(self: Any, timeout: float | None = None) -> None:
        keys = queue_keys(self)
        if not keys:
            return
        if state["idle"]:
            wait = min(IDLE_WAIT, timeout) if timeout else IDLE_WAIT
            command: list[Any] = ["BLPOP", wait_key, wait]
        else:
            command = pop_command(self, keys)
        state["sent"] = command[0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command(*command)

    def read(self: Any, **options: Any) -> Any:
        try:
            got = original_read(**options)
        except Empty:
            state["idle"] = state["sent"] == "EVAL"  # an empty pop waits next; a finished wait pops next
            raise
        state["idle"] = False
        return got

    channel._brpop_start = MethodType(start, channel)
    channel._brpop_read = MethodType(read, channel)
    channel.handlers["BRPOP"] = channel._brpop_read  # the poller calls the handler it saved at init
