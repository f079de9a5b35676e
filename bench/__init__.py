"""PigeonMQ benchmark harness (``python -m bench`` / ``nox -s bench``)."""
