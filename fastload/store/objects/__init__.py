"""Stores in object storage (``s3://bucket/prefix``): URLs, the S3 client and its retries, parallel ranged
transfers, and the manifest that makes an uploaded store visible to readers all at once.

``fastload convert --out s3://...`` (:mod:`fastload.store.upload`), ``fastload stage s3://...``
(:mod:`fastload.store.stage`), ``fastload verify`` and ``fastload info`` build on these modules; boto3 (the
``s3`` extra) is imported only when a URL is used. docs/object-storage.md describes the set-up.
"""
