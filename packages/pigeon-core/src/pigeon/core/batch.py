"""The columnar batch a producer sends, and the broker header that prefixes it when stored.

A batch (one producer send) is built with :class:`BatchBuilder` or :func:`encode_batch`
and read with :func:`decode_batch` (or only its header with :func:`read_header`); a
stored entry is ``entry header | batch``, the 32-byte header packed by
:func:`pack_entry_header` and read by :func:`unpack_entry_header`.  The byte layouts are
documented in :mod:`pigeon.core._batch` and :mod:`pigeon.core._entry`; the builder,
encoder and decoder are :mod:`pigeon.core._batch_builder`, ``_batch_encode`` and
``_batch_decode``.
"""

from __future__ import annotations

from pigeon.core._batch import BatchHeader, read_header
from pigeon.core._batch_builder import BatchBuilder, message_body_size
from pigeon.core._batch_decode import DecodedBatch, decode_batch
from pigeon.core._batch_encode import encode_batch, encode_columns
from pigeon.core._entry import (
    ENTRY_HEADER_SIZE,
    EntryHeader,
    pack_entry_header,
    unpack_entry_header,
)

__all__ = [
    "ENTRY_HEADER_SIZE",
    "BatchBuilder",
    "BatchHeader",
    "DecodedBatch",
    "EntryHeader",
    "decode_batch",
    "encode_batch",
    "encode_columns",
    "message_body_size",
    "pack_entry_header",
    "read_header",
    "unpack_entry_header",
]
