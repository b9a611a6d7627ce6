"""Build the optional C extension of the index core (services/core/_cindex.c).

Everything else is in pyproject.toml. The extension is optional: on a machine without a C
compiler the build logs one line saying so and installs the pure-Python index, which gives
the same results (services/core/cindex.py logs the same at import).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns a missing/failing compiler into a logged fallback."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure means "fall back"
            self._fallback(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._fallback(exc)

    @staticmethod
    def _fallback(exc: Exception) -> None:
        print(
            "kvgate: could not compile the index core C extension "
            f"({type(exc).__name__}: {exc}); installing the pure-Python index instead "
            "(same results, slower)"
        )


setup(
    ext_modules=[
        Extension(
            "services.core._cindex",
            sources=["services/core/_cindex.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
