"""Engines: turn sampled augmentation records into YOLOv9 batches (``cpu``, ``gpu`` [PyTorch], ``dali``).

``base`` holds the contract (:class:`~fastload.engines.base.Engine`, the common
:class:`~fastload.engines.base.EngineSettings`, :class:`~fastload.engines.base.Batch`); each engine
module declares its options class beside its engine; ``factory`` is the registry
(:func:`~fastload.engines.factory.engine_class`, :func:`~fastload.engines.factory.resolve_options`).
Engines never import each other.
"""
