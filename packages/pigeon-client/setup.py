"""The optional C extension of pigeon-client (the rest is in pyproject.toml).

``pigeon.client._speedups`` is the sync producer's ``send_async`` hot path in C. It is
optional: where no C compiler is, the install goes on without it and the client is pure
Python (``pigeon.client._fast``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pigeon.client._speedups",
            ["src/pigeon/client/_speedups.c"],
            optional=True,
        )
    ]
)
