"""GPU side of vlmq: Celery app and tasks, backends, engine, models (installed as vlmq.workers)."""
