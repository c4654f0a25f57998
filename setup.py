"""Map the top-level folders workers/ and kernels/ under the vlmq namespace.

The installed distribution must not put generic names (``workers``, ``kernels``)
into site-packages, so they become ``vlmq.workers`` and ``vlmq.kernels``.
"""
from setuptools import find_packages, setup

ROOTS = {"vlmq": "vlmq", "vlmq.workers": "workers", "vlmq.kernels": "kernels"}


def _packages() -> list[str]:
    names = []
    for prefix, folder in ROOTS.items():
        names.append(prefix)
        names += [f"{prefix}.{sub}" for sub in find_packages(folder)]
    return sorted(set(names))


setup(
    packages=_packages(),
    package_dir=ROOTS,
    package_data={
        "vlmq": ["py.typed", "demo_assets/*"],
        "vlmq.workers": ["assets/*/*", "assets/*/*/*"],
    },
    include_package_data=True,
)
