"""The SDK's module graph: no import cycle among vlmq/*.py, and the front door stays cheap and torch-free."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

VLMQ = Path(__file__).resolve().parents[2] / "vlmq"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """vlmq modules a file imports (anywhere in it: top level, functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from vlmq import keys`` imports the module vlmq.keys; ``from vlmq import X`` otherwise vlmq itself
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= (subs & modules) or {node.module}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    files = {("vlmq" if p.stem == "__init__" else f"vlmq.{p.stem}"): p for p in VLMQ.glob("*.py")}
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_among_vlmq_modules() -> None:
    graph = import_graph()
    assert {"vlmq.client", "vlmq.jobs", "vlmq.store"} <= set(graph)
    assert "vlmq.jobs" in graph["vlmq.client"] and "vlmq.store" in graph["vlmq.jobs"]  # the walk sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_job_uses_nothing_private_from_the_client() -> None:
    assert "vlmq.client" not in import_graph()["vlmq.jobs"]
    assert "._client" not in (VLMQ / "jobs.py").read_text()


def test_front_door_imports_are_cheap_and_torch_free() -> None:
    code = ("import sys, vlmq; heavy = ('redis', 'PIL', 'celery', 'kombu', 'boto3', 'torch'); "
            "early = [m for m in heavy if m in sys.modules]; "
            "from vlmq import Client, Job, JobStatus, JobRequest; "
            "assert Client.__module__ == 'vlmq.client' and Job.__module__ == 'vlmq.jobs'; "
            "print(early, [m for m in ('torch', 'transformers', 'vlmq.workers') if m in sys.modules], "
            "str(JobStatus.QUEUED), f'{JobStatus.FINISHED}')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]", "[]", "queued", "finished"]
