"""Message schemas, as ``pulsar.schema`` names them.

::

    from pigeon.client.schema import AvroSchema, Integer, Record, String

    class User(Record):
        name = String(required=True)
        age = Integer()

    producer = client.create_producer("users", schema=AvroSchema(User))
    producer.send(User(name="ada", age=36))

See docs/messaging.md, "Schemas".
"""

# The names are listed once, in ``_schema.__all__``; this module re-exports exactly those.
from pigeon.client._schema import *  # noqa: F403
from pigeon.client._schema import __all__ as __all__
