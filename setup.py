"""Build script. The package is pure Python (Triton kernels JIT-compile at run time);
install with ``pip install --no-build-isolation .`` so the build sees the torch that is
already installed instead of pulling a second one."""

from setuptools import setup

setup()
