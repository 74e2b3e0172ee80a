"""Build of the optional C extensions; the package metadata lives in pyproject.toml.

``torsh_tune.analysis.traces._scan`` scans Kineto trace JSON into columns, and
``torsh_tune.profiler._lines`` writes the profiler's record lines. Both are optional: without
a C compiler the install still succeeds, trace parsing falls back to Python's ``json`` (several
times slower; `load_traces` then warns) and the record writer to Python's encoding (the same
lines, 6-8x the CPU per line).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class _BuildExt(build_ext):
    """GCC/Clang flags on POSIX compilers only (MSVC takes its defaults)."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = ["-O2", "-Wall", "-Wextra"]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "torsh_tune.analysis.traces._scan",
            ["src/torsh_tune/analysis/traces/_scan.c"],
            optional=True,
        ),
        Extension(
            "torsh_tune.profiler._lines",
            ["src/torsh_tune/profiler/_lines.c"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": _BuildExt},
)
