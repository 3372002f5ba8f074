"""Build hooks: the native libfabric binding (cffi API mode) and the gRPC stubs; metadata lives in
pyproject.toml."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStubs(build_py):
    """Generates the gRPC stubs (protos/_build.py) before the modules are collected, so that an
    installed pdserve, editable or not, has them."""

    def run(self) -> None:
        build = runpy.run_path(str(Path(__file__).resolve().parent / "protos" / "_build.py"))
        build["generate"]()
        super().run()


setup(
    cffi_modules=["workers/fabric/_build.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithStubs},
)
