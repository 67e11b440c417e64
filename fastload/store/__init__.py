"""Stores: one small read interface (:class:`Store`) over files, LMDB, packed disk and shared memory.

Open one with :func:`open_store`; build them with :func:`fastload.store.convert.convert`
(``fastload convert``). Backends live one per module: ``files``, ``lmdb_store``, ``packed`` (disk and
ram share a layout), ``shm`` (shared-memory lifetime), ``gpu``; tools: ``convert``, ``stage``,
``verify``, ``info``.
"""
from fastload.store.base import IncompleteStoreError, Store, StoreError
from fastload.store.factory import open_path, open_store

__all__ = ["Store", "StoreError", "IncompleteStoreError", "open_store", "open_path"]
