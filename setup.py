"""Maps the repository's shared/ and services/ folders onto the `llmgw` package.

shared/   -> llmgw            (the common library)
services/ -> llmgw.services   (one composition root per service)
"""

from setuptools import find_packages, setup


def _under(prefix: str, folder: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(folder)]


setup(
    packages=_under("llmgw", "shared") + _under("llmgw.services", "services"),
    package_dir={"llmgw": "shared", "llmgw.services": "services"},
    package_data={"llmgw": ["py.typed"]},
)
