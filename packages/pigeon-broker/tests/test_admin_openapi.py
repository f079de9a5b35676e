"""Property-based run of the admin API's own OpenAPI document (schemathesis).

Every operation gets generated requests — valid ones and invalid ones (schemathesis'
negative mode) — against a live standalone; none may answer with a 5xx, and every answer
must match the document (status codes, content types, response schemas).  Examples per
operation and mode are bounded so the whole run stays well under a minute.

schemathesis' own pytest plugin does not work with pytest 9, so its Python API builds one
Hypothesis strategy per operation and each operation is a parametrized test here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import hypothesis
import pytest
import schemathesis
from admin_support import AdminStandalone
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from pigeon.broker._admin import make_app
from pigeon.core.testing.fuzz import fuzz_settings

#: PIGEON_ADMIN_FUZZ_EXAMPLES=200 for a longer, randomized run (default: 12, derandomized)
FUZZ = fuzz_settings("PIGEON_ADMIN_FUZZ_EXAMPLES", 12)


def _operations() -> list[Any]:
    # The document does not depend on the broker's state: build it without one.
    document = make_app(SimpleNamespace()).openapi()  # type: ignore[arg-type]
    schema = schemathesis.openapi.from_dict(document)
    return [result.ok() for result in schema.get_all_operations()]


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def seeded(admin_standalone: AdminStandalone) -> AdminStandalone:
    """Some data for generated requests to find: a topic ``0`` with messages, a cursor."""
    admin_standalone.seed_topic("0", "0")
    return admin_standalone


def test_the_document_has_every_operation() -> None:
    assert len(OPERATIONS) == 53


#: Bodies with cross-field rules JSON Schema cannot state (ensemble_size >= write_quorum >=
#: ack_quorum, set together; a schema's text must be an Avro record schema): a
#: schema-valid body may rightly get a 400 there.
CROSS_FIELD_RULES = {
    "PUT /admin/v2/namespaces/{tenant}/{namespace}",
    "PATCH /admin/v2/namespaces/{tenant}/{namespace}/policies",
    "POST /admin/v2/schemas/{tenant}/{namespace}/{topic}/schema",
    "POST /admin/v2/schemas/{tenant}/{namespace}/{topic}/compatibility",
}


def _takes_input(operation: Any) -> bool:
    return bool(list(operation.iter_parameters())) or bool(operation.body)


CASES = [
    pytest.param(op, mode, id=f"{op.label} {mode.value}")
    for op in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or _takes_input(op)  # nothing to get wrong otherwise
]


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_operation_conforms_and_never_fails_with_5xx(
    seeded: AdminStandalone, operation: Any, mode: GenerationMode
) -> None:
    excluded = [positive_data_acceptance] if operation.label in CROSS_FIELD_RULES else []

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @FUZZ
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=seeded.url, excluded_checks=excluded)

    run()
