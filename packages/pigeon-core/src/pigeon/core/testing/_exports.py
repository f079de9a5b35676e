"""A plugin's public facade checked the way ``pigeon.core``'s own is (trio's
``test_exports``): nothing private leaks, nothing public is missing."""

from __future__ import annotations

from types import ModuleType

__all__ = ["check_exports"]


def check_exports(package: ModuleType, *required: str) -> None:
    """Every name of ``package.__all__`` exists, every public object defined in the
    package's own modules is listed, and so are the ``required`` names."""
    exported = set(package.__all__)
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, f"{package.__name__}.__all__ names missing objects: {missing}"
    own = {
        name
        for name, value in vars(package).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith(package.__name__)
    }
    assert own <= exported, f"{package.__name__} does not export {sorted(own - exported)}"
    assert set(required) <= exported, f"{package.__name__} lacks {set(required) - exported}"
