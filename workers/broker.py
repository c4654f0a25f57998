"""The one module that touches kombu's and Celery's private internals.

Written against celery 5.7 and kombu 5.7 (pinned ``~=5.7.0`` in pyproject.toml). ``check_internals()`` runs
at worker start and in ``tests/e2e/test_broker_contract.py``; it names the first internal an upgrade moved.
Internals relied on, and what for:

kombu ``kombu.transport.redis.Channel`` (the consumer's task channel):
  - ``_brpop_start(timeout)``, ``_brpop_read(**options)``: send and read the consuming pop. Replaced by the
    atomic pop below, which also passes each raw message through the message gate before kombu decodes it.
  - ``handlers["BRPOP"]``: the poller calls the read handler it saved at init; replaced too.
  - ``_queue_cycle.consume(n)``, ``_queue_cycle.rotate(queue)``, ``active_queues``: round robin over queues.
  - ``_q_for_pri(queue, pri)``, ``priority_steps``, ``sep``: priority sub-lists (must equal ``vlmq.keys``').
  - ``unacked_key``, ``unacked_index_key``, ``global_keyprefix``: unacked structures (must equal
    ``vlmq.keys.UNACKED`` / ``UNACKED_INDEX``; no prefix).
  - ``client`` (``connection.send_command``, ``parse_response``), ``connection_errors``: raw commands.
  - ``Channel.connection_class`` (class attribute): the redis-py connection class every channel connects with;
    replaced by one that reads "not now" replies (``BUSY``, ``LOADING``, ``OOM``, ...) as a lost connection.
  - ``_in_poll``, ``_brpop_sent_at``, ``_flush_brpop_reauth()``: poll bookkeeping kombu's own read keeps.
  - ``connection._deliver(message, queue)``: hands a decoded envelope to the consumer's callbacks.
  - ``qos.can_consume()``: whether the consumer may fetch now; narrowed by the cost gate.
  - ``qos.ack(tag)``: acks a refused message (kombu's unacked structures and its in-memory ones).
  - the stored message form: ``json.dumps`` with default separators, so the routing key reads
    ``"routing_key": "<queue>"``. ``vlmq.affinity.DRAIN_SCRIPT`` rewrites that text when it moves a worker
    queue's messages to the shared queue (the message gate checks it; kombu restores by it).
celery:
  - ``celery.worker.state.reserved_requests`` and ``active_requests``: the requests a worker holds; of each,
    ``Request.message.delivery_tag`` and ``Request.delivery_info["routing_key"]``.
  - the consumer bootstep ``celery.worker.consumer.tasks:Tasks`` and ``Consumer.task_consumer.channel``.

The atomic pop: kombu pops with ``BRPOP`` and records the message as unacked afterwards (``ZADD``
``unacked_index``, ``HSET`` ``unacked``); a worker killed between the two loses the message for good (the
chaos test caught one). A Lua script pops the first message of the given keys and records it unacked in
the same step, with kombu's delivery tag and stored form (``[message, exchange, routing_key]``); kombu's
``QoS.append`` writes the same entries again, harmlessly. Lua cannot block, so after a pop that found
every queue empty the next command is a short server-side wait (``BLPOP`` on a key nobody writes).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from queue import Empty
from types import MethodType
from typing import Any, Protocol

from vlmq import keys

log = logging.getLogger(__name__)
IDLE_WAIT = 0.1  # seconds an idle worker waits between pops
MAX_MESSAGE_BYTES = 64 * 1024  # a vlmq envelope is about 1 KB; a longer one is refused before it leaves Redis
CONSUMER_TASKS_STEP = "celery.worker.consumer.tasks:Tasks"


class BrokerContractError(RuntimeError):
    """A kombu/Celery internal this module relies on is missing or changed (an upgrade moved it)."""


# (dotted name, module, attribute path) of every internal, checked by ``check_internals``
INTERNALS: tuple[tuple[str, str], ...] = (
    ("kombu.transport.redis", "Channel._brpop_start"),
    ("kombu.transport.redis", "Channel._brpop_read"),
    ("kombu.transport.redis", "Channel._q_for_pri"),
    ("kombu.transport.redis", "Channel._flush_brpop_reauth"),
    ("kombu.transport.redis", "Channel.unacked_key"),
    ("kombu.transport.redis", "Channel.unacked_index_key"),
    ("kombu.transport.redis", "Channel.global_keyprefix"),
    ("kombu.transport.redis", "Channel.sep"),
    ("kombu.transport.redis", "Channel.priority_steps"),
    ("kombu.transport.redis", "Channel.connection_class"),
    ("kombu.transport.redis", "QoS.can_consume"),
    ("kombu.transport.redis", "QoS.ack"),
    ("kombu.transport.virtual.base", "Transport._deliver"),
    ("kombu.utils.scheduling", "priority_cycle.consume"),
    ("kombu.utils.scheduling", "priority_cycle.rotate"),
    ("celery.worker.state", "reserved_requests"),
    ("celery.worker.state", "active_requests"),
    ("celery.worker.consumer.tasks", "Tasks"),
)
# attributes a live task channel must carry (set in its __init__, so not on the class)
CHANNEL_ATTRIBUTES = ("handlers", "_queue_cycle", "active_queues", "client", "connection", "qos",
                      "connection_errors", "_in_poll")

# KEYS[1] unacked hash, KEYS[2] unacked index, KEYS[3..] the queue keys in priority order; ARGV[1] now,
# ARGV[2] the longest message returned whole. Returns {key, message, state, delivery tag} or false; state is
# "recorded" (now unacked), "unrecorded" (no tag: not kombu's form), "duplicate" (tag already held: forged)
# or "oversized" (only the first ARGV[2] bytes come back).
POP_SCRIPT = """
for i = 3, #KEYS do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local limit = tonumber(ARGV[2])
    if #item > limit then return {KEYS[i], string.sub(item, 1, limit), 'oversized', ''} end
    local ok, m = pcall(cjson.decode, item)
    local p = ok and type(m) == 'table' and m['properties']
    local tag = type(p) == 'table' and p['delivery_tag']
    local info = type(p) == 'table' and p['delivery_info']
    if type(tag) ~= 'string' or type(info) ~= 'table' then return {KEYS[i], item, 'unrecorded', ''} end
    if redis.call('HEXISTS', KEYS[1], tag) == 1 then return {KEYS[i], item, 'duplicate', tag} end
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    redis.call('HSET', KEYS[1], tag,
      '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    return {KEYS[i], item, 'recorded', tag}
  end
end
return false
"""
# error replies that mean "not now": a script past busy-reply-threshold (BUSY), a server loading its data or failing
# over, a replica, a full or misconfigured one; kombu's connections read them as a lost connection (reconnect, never
# exit). LOADING is redis-py's BusyLoadingError, a ConnectionError already.
TRANSIENT_REPLIES = frozenset({"BUSY", "LOADING", "TRYAGAIN", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "OOM",
                               "MISCONF", "NOREPLICAS"})
POP_REFUSALS = {
    "oversized": f"oversized: the message is longer than {MAX_MESSAGE_BYTES} bytes",
    "duplicate": "duplicate_delivery_tag: another held message has this delivery tag",
}


class MessageGate(Protocol):
    """What the pop asks about each raw message before kombu decodes it (``vlmq.workers.gate.Gate``)."""

    def check(self, queue: str, raw: bytes) -> tuple[dict[str, Any] | None, str]:
        """The decoded envelope to deliver, or None and the reason to refuse it."""

    def dead_letter(self, redis: Any, queue: str, reason: str, raw: bytes) -> None:
        """Keep a refused message where operators can read it."""


def _resolve(module: str, path: str) -> object:
    import importlib

    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_internals() -> None:
    """Raise ``BrokerContractError`` naming the first internal this module relies on that is missing."""
    for module, path in INTERNALS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError) as e:
            raise BrokerContractError(f"{module}.{path} is missing ({e}); vlmq.workers.broker was written "
                                      "against celery/kombu 5.7: pin them or port the broker seam") from e


def check_channel(channel: Any) -> None:
    """Raise ``BrokerContractError`` unless ``channel`` is a kombu Redis channel laid out as ``vlmq.keys`` says."""
    check_internals()
    for name in CHANNEL_ATTRIBUTES:
        if not hasattr(channel, name):
            raise BrokerContractError(f"kombu.transport.redis.Channel.{name} is missing; the vlmq atomic pop "
                                      "needs the Redis transport of kombu 5.7")
    if "BRPOP" not in channel.handlers:
        raise BrokerContractError("kombu.transport.redis.Channel.handlers['BRPOP'] is missing")
    if channel.global_keyprefix:
        raise BrokerContractError("the vlmq atomic pop does not support kombu's global_keyprefix")
    layout = {"unacked_key": keys.UNACKED, "unacked_index_key": keys.UNACKED_INDEX}
    for name, expected in layout.items():
        if getattr(channel, name) != expected:
            raise BrokerContractError(f"kombu's {name} is {getattr(channel, name)!r}; vlmq.keys says {expected!r}")
    for pri in channel.priority_steps:
        if channel._q_for_pri("q", pri) != keys.priority_list("q", pri):
            raise BrokerContractError(f"kombu's priority list for step {pri} is {channel._q_for_pri('q', pri)!r}; "
                                      f"vlmq.keys says {keys.priority_list('q', pri)!r}")


def task_channel(consumer: Any) -> Any:
    """The kombu channel a Celery consumer fetches tasks on."""
    return consumer.task_consumer.channel


def held_requests() -> list[Any]:
    """The requests this worker process holds (reserved includes running)."""
    from celery.worker import state

    return list(state.reserved_requests) + list(state.active_requests)


def held_queues() -> list[str]:
    """The queue of each message this worker holds, one entry per message."""
    from celery.worker import state

    return [(r.delivery_info or {}).get("routing_key", "") for r in list(state.reserved_requests)]


def held_delivery_tags() -> list[str]:
    return list({r.message.delivery_tag for r in held_requests() if r.message is not None})


def renew_leases(redis: Any, tags: Sequence[str]) -> None:
    """Refresh the delivery time of held messages (``XX``: never re-adds an acked tag)."""
    if tags:
        redis.zadd(keys.UNACKED_INDEX, {tag: time.time() for tag in tags}, xx=True)


def pop_command(queue_keys: Sequence[str]) -> list[Any]:
    """The ``EVAL`` command that pops the first message of ``queue_keys`` and marks it unacked."""
    script_keys = [keys.UNACKED, keys.UNACKED_INDEX, *queue_keys]
    return ["EVAL", POP_SCRIPT, len(script_keys), *script_keys, repr(time.time()), MAX_MESSAGE_BYTES]


def pop_keys(channel: Any, allowed: set[str], first: frozenset[str] = frozenset()) -> list[str]:
    """kombu's queue cycle restricted to ``allowed`` queues, as Redis lists in priority-major order.

    Within each priority step the queues in ``first`` (the worker's own queues) come before the others.
    """
    queues = [q for q in channel._queue_cycle.consume(len(channel.active_queues)) if q in allowed]
    queues.sort(key=lambda q: q not in first)  # stable: the cycle's order within each group
    return [keys.priority_list(q, pri) for pri in channel.priority_steps for q in queues]


def install(channel: Any, allowed: Callable[[], set[str]], gate: MessageGate,
            first: frozenset[str] = frozenset()) -> None:
    """Consume only from the queues ``allowed()`` returns, those in ``first`` before the others at each priority,
    with the atomic pop and the message gate."""
    check_channel(channel)
    original = channel.qos.can_consume
    channel.qos.can_consume = MethodType(lambda qos: bool(allowed()) and original(), channel.qos)
    _install_pop(channel, lambda ch: pop_keys(ch, allowed(), first), gate)


def _install_pop(channel: Any, queue_keys: Callable[[Any], list[str]], gate: MessageGate) -> None:
    wait_key = keys.idle_wait(uuid.uuid4().hex)
    state = {"idle": False, "sent": ""}

    def start(self: Any, timeout: float | None = None) -> None:
        popped_from = queue_keys(self)
        if not popped_from:
            return
        if state["idle"]:
            # woken early by a producer's token on the wake list of any queue it pops (vlmq.keys.wake)
            wake_keys = sorted({keys.wake(k.rsplit(keys.PRIORITY_SEP, 1)[0]) for k in popped_from})
            command: list[Any] = ["BLPOP", wait_key, *wake_keys, min(IDLE_WAIT, timeout) if timeout else IDLE_WAIT]
        else:
            command = pop_command(popped_from)
        state["sent"] = command[0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command(*command)

    def read(self: Any, **options: Any) -> bool:
        try:
            reply = _read_reply(self, **options)
        except Empty:
            state["idle"] = state["sent"] == "EVAL"  # an empty pop waits next; a finished wait pops next
            raise
        state["idle"] = False
        dest, raw, pop_state, tag = reply
        queue = dest.decode().rsplit(keys.PRIORITY_SEP, 1)[0]
        self._queue_cycle.rotate(queue)
        _admit(self, gate, queue, raw, pop_state.decode(), tag.decode())
        return True

    channel._brpop_start = MethodType(start, channel)
    channel._brpop_read = MethodType(read, channel)
    channel.handlers["BRPOP"] = channel._brpop_read  # the poller calls the handler it saved at init


def transient(error: Exception) -> bool:
    """Whether a Redis error reply says "not now" (a busy, loading, failing-over, read-only or full server)."""
    import redis as redis_lib

    code = getattr(error, "status_code", None) or str(error).split(" ", 1)[0]
    return isinstance(error, redis_lib.exceptions.ResponseError) and code in TRANSIENT_REPLIES


def transient_as_lost() -> type:
    """A ``redis.Connection`` that reads a "not now" reply as a lost connection (kombu's channels use it).

    kombu takes any other error reply for a broken channel, and Celery stops the worker on one: a worker whose pop
    or ack was answered ``BUSY`` (a script past ``busy-reply-threshold``) exited. As a lost connection, redis-py
    retries the command and kombu reconnects instead; a refusal for good (``NOPERM``, ...) still stops the worker,
    which then exits non-zero (``vlmq.workers.main``).
    """
    import redis as redis_lib

    class TransientAsLost(redis_lib.Connection):
        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except redis_lib.exceptions.ResponseError as e:
                if not transient(e):
                    raise
                self.disconnect()  # the rest of a pipeline's replies are still on the socket
                raise redis_lib.exceptions.ConnectionError(f"the broker answered {e}; reconnecting") from e

    return TransientAsLost


def use_transient_as_lost() -> None:
    """Every kombu Redis channel made from now on connects with :func:`transient_as_lost` (call before connecting)."""
    from kombu.transport import redis as kombu_redis

    kombu_redis.Channel.connection_class = transient_as_lost()


def _read_reply(channel: Any, **options: Any) -> Any:
    try:
        try:
            reply = channel.client.parse_response(channel.client.connection, "BRPOP", **options)
        except channel.connection_errors:
            channel.client.connection.disconnect()  # the next poll reconnects
            raise
        if not reply or len(reply) != 4:  # an empty pop, or the end of an idle wait
            raise Empty()
        return reply
    finally:
        channel._in_poll = None
        channel._flush_brpop_reauth()


def _admit(channel: Any, gate: MessageGate, queue: str, raw: bytes, pop_state: str, tag: str) -> None:
    """Deliver a message that passes the gate; dead-letter and ack anything else. Never raises for a message."""
    message, reason = (None, POP_REFUSALS[pop_state]) if pop_state in POP_REFUSALS else gate.check(queue, raw)
    if message is not None:
        try:
            channel.connection._deliver(message, queue)
            return
        except channel.connection_errors:
            raise
        except Exception as e:  # one message must never stop the consumer loop
            log.exception("message from %s broke the consumer; dead-lettering it", queue)
            reason = f"consumer_error: {type(e).__name__}: {e}"
    log.warning("refused a message from %s: %s", queue, reason)
    gate.dead_letter(channel.client, queue, reason, raw)
    if pop_state == "recorded":
        channel.qos.ack(tag)  # out of kombu's unacked structures (and its in-memory ones, if it got that far)
