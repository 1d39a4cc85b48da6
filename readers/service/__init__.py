"""The reader service: ``recpipe serve`` streams preprocessed batches to trainers over TCP.

Reader processes (``multiprocessing``, spawn) run the reader pipeline and encode each
:class:`~recpipe.batch.Batch` into a frame (:mod:`readers.service.wire`: raw tensor buffers
behind a small header, no pickle on the wire). The server relays the frames to its clients; a
trainer reads them through :class:`ServiceDataset`, an ``IterableDataset`` for its DataLoader::

    $ RECPIPE_TOKEN=s3cret recpipe serve data/demo/dataset --readers 2    # on the reader host
    recpipe serve: listening on 127.0.0.1:5717 ...

    loader = DataLoader(ServiceDataset("127.0.0.1", 5717, token="s3cret"), batch_size=None)

The package, one concept per module (each imports only the ones above it):

==================  ============================================================================
``wire``            the frame format, batch <-> frame, the service's errors
``config``          :class:`ServiceConfig` (every limit), :class:`ServerStats`, :class:`SessionStats`
``producers``       what readers run: :class:`ShardSpec`, :class:`DatasetProducer`, ...
``reader_process``  reader processes and threads, and the server's pool of them
``session``         one client: its handshake (the conversation), readers, queue, backpressure
``server``          :class:`ReaderServer`: accepting, limits, shutdown; :func:`serve`
``client``          :class:`ServiceClient`, :class:`ServiceDataset`, :class:`ServiceStream`
``cli``             ``recpipe serve`` (:func:`register_cli`)
==================  ============================================================================

The public names are re-exported here lazily, so that ``recpipe --help`` imports only what it
needs.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "TOKEN_ENV",
    "BatchProducer",
    "DatasetProducer",
    "ProtocolError",
    "ReaderServer",
    "ServerStats",
    "ServiceBusyError",
    "ServiceClient",
    "ServiceConfig",
    "ServiceDataset",
    "ServiceError",
    "ServiceStream",
    "SessionStats",
    "ShardSpec",
    "SyntheticProducer",
    "register_cli",
    "serve",
]

_WHERE = {
    "readers.service.wire": ("ProtocolError", "ServiceBusyError", "ServiceError"),
    "readers.service.config": ("TOKEN_ENV", "ServerStats", "ServiceConfig", "SessionStats"),
    "readers.service.producers": (
        "BatchProducer", "DatasetProducer", "ShardSpec", "SyntheticProducer",
    ),
    "readers.service.server": ("ReaderServer", "serve"),
    "readers.service.client": ("ServiceClient", "ServiceDataset", "ServiceStream"),
    "readers.service.cli": ("register_cli",),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
