"""The distribution's layout (the rest of the metadata is in pyproject.toml).

The repository keeps the suites, fixtures and goldens at the top level; the build maps them into the
package, so a wheel or sdist carries everything the suite needs:

    suites/    -> mla_conformance.suites    (wholesale: every subpackage and data file under it)
    fixtures/  -> mla_conformance.fixtures  (the tiny models, prompts, MANIFEST.sha256; not the train_tiny*.py)
    golden/    -> mla_conformance.goldens   (the goldens, read-only package data outside a checkout)

An editable install (``pip install -e .``) maps the same package names to these directories, so the
checkout's files are what is read and written. ``mla_conformance.resources`` finds them.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

MAPPED = {"mla_conformance.suites": "suites", "mla_conformance.fixtures": "fixtures",
          "mla_conformance.goldens": "golden"}
NOT_SHIPPED = {("mla_conformance.fixtures", "train_tiny"),  # the training scripts stay in the repository
               ("mla_conformance.fixtures", "train_tiny_v4")}


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] not in NOT_SHIPPED]


setup(
    packages=[*find_packages(include=["mla_conformance", "mla_conformance.*"]), *MAPPED,
              *(f"mla_conformance.suites.{p}" for p in find_packages("suites"))],
    package_dir=MAPPED,
    package_data={"mla_conformance.suites": ["**/*"],
                  "mla_conformance.fixtures": ["*.json", "*.sha256", "models/**/*"],
                  "mla_conformance.goldens": ["**/*.json"]},
    exclude_package_data={"": ["*__pycache__*", "*.py[co]"]},
    cmdclass={"build_py": BuildPy},
)
