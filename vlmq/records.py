"""Job records and their atomic transitions: moved to ``vlmq.store``; these names stay for existing imports."""
from vlmq.store import JobStatus, decode_record, now, read, transition

__all__ = ["JobStatus", "decode_record", "now", "read", "transition"]
