"""Our folders workers/ and kernels/ are ``vlmq.workers`` and ``vlmq.kernels``, never top-level packages.

A checkout's root on ``sys.path`` (``python -m ...``, ``python -c``, pytest, from the repository root) makes
``import kernels`` find our kernels/ folder before Hugging Face's ``kernels`` package, which transformers
imports. Each folder's ``__init__`` therefore checks the name it is imported by and, imported as a top-level
name, calls :func:`step_aside`: the installed package of that name takes its place in ``sys.modules``; with none
installed, the folder reads as a bare directory would (an empty PEP 420 namespace: ``__file__`` None, nothing
inside), which is what probes such as transformers' ``_is_package_available`` (find_spec, then import when no
metadata names a version) already treat as "not installed"; raising instead broke every such probe. Usage, first
lines of ``kernels/__init__.py``::

    if __name__ != "vlmq.kernels":
        from vlmq._toplevel import step_aside
        step_aside(__name__, __file__)
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def step_aside(name: str, init_file: str) -> None:
    """Load the package ``name`` from ``sys.path`` without our checkout's root, in place of our folder.

    Args:
        name: the top-level name the folder was imported by (``kernels`` or ``workers``).
        init_file: the folder's ``__init__.py`` (``__file__``).

    With no other package of that name installed, ``sys.modules[name]`` becomes an empty namespace module: ``import
    kernels`` succeeds as it would for a bare ``kernels/`` directory, ``from kernels import X`` and ``import
    kernels.x`` fail with ImportError ("unknown location"), as they would there.
    """
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        sys.modules[name] = _bare_directory(name, root)
        return
    module = importlib.util.module_from_spec(spec)
    # the import system returns whatever sys.modules holds for the name once this __init__ ends
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _bare_directory(name: str, root: str) -> types.ModuleType:
    """What ``import name`` gives for a folder without ``__init__.py``: a namespace with no file and nothing in it."""
    module = types.ModuleType(name, f"{root}/{name}/ is vlmq.{name}; no other package {name!r} is installed")
    module.__file__ = None
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = []
    return module
