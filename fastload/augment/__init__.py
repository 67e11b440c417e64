"""Augmentation: hyper-parameters, the parameter sampler, box maths and pure pixel kernels.

Parameters are sampled in one place (:class:`~fastload.augment.params.ParamSampler`); engines only
apply the records (:func:`~fastload.augment.pipeline.render_sample` on the CPU) and move boxes
with :func:`~fastload.augment.boxes.batch_targets` / :func:`~fastload.augment.boxes.transform_labels`.  Imports no engine.
"""
from fastload.augment.boxes import batch_targets, transform_labels
from fastload.augment.hyp import HYP_SCRATCH_HIGH, load_hyp
from fastload.augment.params import ImageParams, ParamSampler, SampleParams, TileParams, rect_batch_shapes
from fastload.augment.pipeline import render_sample

__all__ = [
    "HYP_SCRATCH_HIGH",
    "load_hyp",
    "TileParams",
    "ImageParams",
    "SampleParams",
    "ParamSampler",
    "rect_batch_shapes",
    "batch_targets",
    "transform_labels",
    "render_sample",
]
