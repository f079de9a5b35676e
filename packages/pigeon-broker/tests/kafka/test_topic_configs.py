"""Kafka topic configs without I/O: what is stored, what is accepted and left out, what
is refused (INVALID_CONFIG), and IncrementalAlterConfigs' operations."""

from __future__ import annotations

import pytest

from pigeon.broker._topic_configs import (
    APPEND,
    DELETE,
    SET,
    SUBTRACT,
    apply_changes,
    check_config,
    dirty_ratio,
    is_compacted,
)
from pigeon.core.errors import InvalidArgument


def test_cleanup_policy_values() -> None:
    assert check_config("cleanup.policy", "compact") == "compact"
    assert check_config("cleanup.policy", "delete, compact") == "compact,delete"
    assert check_config("min.cleanable.dirty.ratio", "0") == "0.0"
    assert check_config("retention.ms", "1000") is None  # accepted, not stored
    for name, value in [
        ("cleanup.policy", "shred"),
        ("cleanup.policy", "compact,compact"),
        ("cleanup.policy", None),
        ("min.cleanable.dirty.ratio", "1.5"),
        ("min.cleanable.dirty.ratio", "nan"),
        ("no.such.config", "1"),
    ]:
        with pytest.raises(InvalidArgument, match=name.split(".")[0]):
            check_config(name, value)


def test_incremental_operations() -> None:
    config = apply_changes({}, [("cleanup.policy", SET, "compact")])
    assert config == {"cleanup.policy": "compact"} and is_compacted(config)
    config = apply_changes(config, [("cleanup.policy", APPEND, "delete")])
    assert config == {"cleanup.policy": "compact,delete"} and is_compacted(config)
    config = apply_changes(config, [("cleanup.policy", SUBTRACT, "compact")])
    assert config == {"cleanup.policy": "delete"} and not is_compacted(config)
    with pytest.raises(InvalidArgument, match="empty"):
        apply_changes(config, [("cleanup.policy", SUBTRACT, "delete")])
    with pytest.raises(InvalidArgument, match="not a list"):
        apply_changes(config, [("min.cleanable.dirty.ratio", APPEND, "0.1")])
    config = apply_changes(config, [("min.cleanable.dirty.ratio", SET, "0.25")])
    assert dirty_ratio(config) == 0.25
    assert apply_changes(config, [("cleanup.policy", DELETE, None)]) == {
        "min.cleanable.dirty.ratio": "0.25"
    }
    assert dirty_ratio({}) == 0.5 and not is_compacted({})
    with pytest.raises(InvalidArgument, match="operation"):
        apply_changes({}, [("cleanup.policy", 9, "compact")])
