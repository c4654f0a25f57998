"""Our folders workers/ and kernels/ are ``vlmq.workers`` and ``vlmq.kernels``, never top-level packages.

A checkout's root on ``sys.path`` (``python -m ...``, ``python -c``, pytest, from the repository root) makes
``import kernels`` find our kernels/ folder before Hugging Face's ``kernels`` package, which transformers
imports. Each folder's ``__init__`` therefore checks the name it is imported by and, imported as a top-level
name, calls :func:`step_aside`: the installed package of that name takes its place in ``sys.modules``, or the
import fails as if the folder were not there. Usage, first lines of ``kernels/__init__.py``::

    if __name__ != "vlmq.kernels":
        from vlmq._toplevel import step_aside
        step_aside(__name__, __file__)
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, init_file: str) -> None:
    """Load the package ``name`` from ``sys.path`` without our checkout's root, in place of our folder.

    Args:
        name: the top-level name the folder was imported by (``kernels`` or ``workers``).
        init_file: the folder's ``__init__.py`` (``__file__``).

    Raises:
        ModuleNotFoundError: when no other package of that name is installed (as if our folder were absent).
    """
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} ({root}/{name}/ is vlmq.{name}, not {name!r})",
                                  name=name)
    module = importlib.util.module_from_spec(spec)
    # the import system returns whatever sys.modules holds for the name once this __init__ ends
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
