"""Job records and their atomic transitions: moved to ``vlmq.store``; these names stay for existing imports."""
from vlmq.store import DONE_TTL, JobStatus, decode_record, now, read, transition

__all__ = ["DONE_TTL", "JobStatus", "decode_record", "now", "read", "transition"]
