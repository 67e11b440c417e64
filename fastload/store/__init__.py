"""Stores: one small read interface (:class:`Store`) over files, LMDB, packed disk and shared memory.

Open one with :func:`open_store`; build them with :func:`fastload.store.convert.convert`
(``fastload convert``). Layout of the package (each module imports only those above it):

* ``base`` (the :class:`Store` interface, errors), ``kinds`` (kind names, the shm root, recognising
  a store folder), ``space`` (byte formatting, free-space checks), ``shm`` (shared-memory lifetime);
* backends, one per module: ``files``, ``lmdb_store``, ``packed`` (disk and ram share a layout),
  ``gpu`` (device-resident), and ``view`` (a subset of another store, as the loader sees it);
* ``convert`` (writes stores), ``factory`` (:func:`open_store`, the registry of kinds), then the
  tools ``stage``, ``verify``, ``info``.
"""
from fastload.store.base import IncompleteStoreError, Store, StoreError
from fastload.store.factory import open_path, open_store

__all__ = ["Store", "StoreError", "IncompleteStoreError", "open_store", "open_path"]
