"""Build hook for the native libfabric binding (cffi API mode); metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["workers/fabric/_build.py:ffibuilder"])
