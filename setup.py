"""Map the top-level folders workers/ and kernels/ under the vlmq namespace.

The installed distribution must not put generic names (``workers``, ``kernels``)
into site-packages, so they become ``vlmq.workers`` and ``vlmq.kernels``.

One optional C extension: Pillow's bicubic resize fused with the Qwen2-VL patching
(workers/engine/_resample.c). ``optional=True``: where it cannot be compiled the
install still succeeds and image preprocessing uses PIL's resize instead.
"""
from setuptools import Extension, find_packages, setup

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
    ext_modules=[
        Extension(
            "vlmq.workers.engine._resample",
            sources=[f"workers/engine/_resample{part}.c" for part in ("", "_kernels", "_avx2")],
            depends=["workers/engine/_resample.h"],
            # portable: no -march (installs move between machines; AVX2 copies of the hot loops are picked at
            # run time); -fno-wrapv undoes the -fwrapv in CPython's CFLAGS, which stops GCC vectorising the int
            # loops; no FMA contraction, so the filter weights round as Pillow's do
            extra_compile_args=["-O3", "-fno-wrapv", "-ffp-contract=off"],
            optional=True,
        )
    ],
)
