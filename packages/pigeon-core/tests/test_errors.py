"""The error tree: unique wire codes, rebuilding errors from codes, retriable flags."""

from __future__ import annotations

import pytest

from pigeon.core import errors
from pigeon.core.errors import PigeonError, error_from_code


def _all_subclasses(cls: type[PigeonError]) -> list[type[PigeonError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


# the one error tree (DESIGN §11); test modules may define subclasses of their own
ERROR_CLASSES = sorted(
    {c for c in _all_subclasses(PigeonError) if c.__module__ == errors.__name__},
    key=lambda c: c.__name__,
)


def test_the_tree_is_not_empty() -> None:
    assert len(ERROR_CLASSES) > 30


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_class_has_its_own_code(cls: type[PigeonError]) -> None:
    # an inherited code would make error_from_code rebuild the parent class
    assert "code" in cls.__dict__, f"{cls.__name__} does not define its own wire code"
    assert isinstance(cls.code, int) and cls.code > 1


def test_codes_are_unique() -> None:
    by_code: dict[int, str] = {}
    for cls in [PigeonError, *ERROR_CLASSES]:
        assert cls.code not in by_code, f"{cls.__name__} and {by_code[cls.code]} share {cls.code}"
        by_code[cls.code] = cls.__name__


def test_reusing_a_code_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="TopicNotFound"):
        type("Dup", (PigeonError,), {}, code=errors.TopicNotFound.code)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_error_from_code_round_trip(cls: type[PigeonError]) -> None:
    sent = cls("something went wrong: 42")
    got = error_from_code(sent.wire_code, sent.message)
    assert type(got) is cls
    assert got.message == "something went wrong: 42"
    assert got.wire_code == cls.code
    assert got.retriable == cls.retriable


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_public_in_errors_module(cls: type[PigeonError]) -> None:
    assert cls.__name__ in errors.__all__


def test_unknown_code_keeps_the_code() -> None:
    got = error_from_code(9999, "from a newer peer")
    assert type(got) is PigeonError
    assert got.wire_code == 9999
    assert got.message == "from a newer peer"
    assert not got.retriable
    # re-sending it passes the original code on
    assert error_from_code(got.wire_code, got.message).wire_code == 9999


def test_empty_message_falls_back_to_class_name() -> None:
    assert errors.TopicNotFound().message == "TopicNotFound"
    assert error_from_code(errors.TopicNotFound.code, "").message == "TopicNotFound"


def test_errors_are_catchable_by_group() -> None:
    with pytest.raises(errors.StorageError):
        raise error_from_code(errors.SegmentFenced.code, "fenced")
    with pytest.raises(errors.ProtocolError):
        raise error_from_code(errors.FrameTooLarge.code, "big")
    with pytest.raises(errors.InvalidArgument):
        raise error_from_code(errors.InvalidTopicName.code, "bad")


@pytest.mark.parametrize(
    ("cls", "retriable"),
    [
        (errors.ConnectionClosed, True),
        (errors.Timeout, True),
        (errors.ServiceUnavailable, True),
        (errors.ProducerQueueFull, True),
        (errors.ProducerBusy, True),
        (errors.StorageError, True),
        (errors.BookieReadOnly, True),
        (errors.MetadataError, True),
        # a subclass can be final even when its group is transient
        (errors.SegmentNotFound, False),
        (errors.SegmentFenced, False),
        (errors.BadVersion, False),
        (errors.NoSuchNode, False),
        (errors.ProtocolError, False),
        (errors.ProtocolVersionMismatch, False),
        (errors.InvalidTopicName, False),
        (errors.MessageTooLarge, False),
        (errors.TopicNotFound, False),
        (errors.ConfigError, False),
        (errors.AlreadyClosed, False),
    ],
)
def test_retriable_flags(cls: type[PigeonError], retriable: bool) -> None:
    assert cls.retriable is retriable
    assert cls("x").retriable is retriable


def test_code_groups() -> None:
    """Codes are grouped by area, so a log reader can tell the kind at a glance."""
    assert 100 <= errors.ProtocolError.code < 200
    assert 200 <= errors.InvalidArgument.code < 300
    assert 300 <= errors.TopicNotFound.code < 400
    assert 400 <= errors.StorageError.code < 500
    assert 500 <= errors.MetadataError.code < 600
    assert 600 <= errors.ConfigError.code < 700
