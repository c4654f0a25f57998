"""GPU side of vlmq: Celery app and tasks, backends, engine, models (installed as vlmq.workers).

Imported as a top-level ``workers`` (a checkout's root on sys.path), this folder steps aside for an installed
package of that name, or fails as if it were absent: see vlmq/_toplevel.py.
"""
if __name__ != "vlmq.workers":
    from vlmq._toplevel import step_aside

    step_aside(__name__, __file__)
