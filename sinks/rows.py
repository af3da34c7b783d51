"""The names other parts of the project import from the sink's conversion, in one
place: :class:`Batch` and :class:`Message` (what a message becomes, and what it is),
:data:`COLUMNS` and :data:`TABLES` (what the sink writes).

The conversion itself lives in one module per concern: sinks.tables (columns, rows
held as columns), sinks.checks (one value at a time), sinks.typed (msgspec field kinds
and the typed envelope decoder), sinks.events and sinks.records (one converter per
signal), sinks.batch (a batch of messages, dead letters).
"""

from __future__ import annotations

from dask_blackbox.sinks.batch import Batch, fingerprint, payload_of
from dask_blackbox.sinks.tables import COLUMNS, TABLES, FlatLists, Message, TableData

__all__ = ["COLUMNS", "TABLES", "Batch", "FlatLists", "Message", "TableData", "fingerprint",
           "payload_of"]
