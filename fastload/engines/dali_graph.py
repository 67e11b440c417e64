"""The DALI graph of ``engine="dali"``: decode, loaded resize, tiles, mixup, flips, CHW.

One graph serves GPU and CPU-only mode: ``device_id=None`` puts every operator on the CPU (the
decoder included); otherwise JPEGs are decoded by ``fn.decoders.image(device="mixed")`` (nvJPEG /
the hardware decoder) and all pixel work runs on the GPU. A *loaded* image is
``resize(decode(bytes), loaded size)`` (encoded stores, antialiased linear filter where OpenCV uses
INTER_AREA; decoded stores send the loaded array). With ``partners="dataset"`` every tile slot
carries its own image, loaded in the slot; with ``partners="batch"`` each sample's own image is
loaded once and slot ``k`` takes the loaded image of the sample at its batch position with
``fn.permute_batch`` (one decode per sample). Per tile slot ``k`` (see
:mod:`fastload.engines.dali_source`):

* ``part``/``crop`` = slices of the slot's loaded image;
* ``W = warp_affine(part, A_part, fill 0)`` (float), ``L = warp_affine(ones(part), A_part, fill 0)``
  (bilinear coverage), ``R = warp_affine(ones(crop), A_crop, nearest, fill 0)`` (the output pixels
  whose nearest source pixel is in the crop: the reference's rectangle for axis-aligned tiles);
* resize tiles: ``value = W / L`` (edge taps renormalised, like the reference's clamped part),
  ``cover = R``; warped tiles: ``value = W``, ``cover = L`` (BORDER_TRANSPARENT: partial coverage
  blends with what is there);
* painted in order: ``canvas = value * weight + (1 - cover * weight) * canvas`` from the fill.

Then both canvases are rounded to uint8, blended (``floor(a * r + b * (1 - r))``), flipped and,
for ``layout="nchw"``, transposed to CHW. HSV is applied after the graph, on the output batch, with
:func:`~fastload.augment.functional.torch_ops.apply_hsv_batch` in the records' rule (YOLOv9's multiplicative hue
has no DALI operator; ``fn.hsv`` shifts hue additively in float HSV, not in OpenCV's 8-bit levels as Ultralytics'
additive hue does).
"""
from __future__ import annotations

from typing import Any

from fastload.engines.base import Layout
from fastload.engines.dali_source import HEAD, PLACEMENT, SampleSource, TileSlots, n_outputs

__all__ = ["build_pipeline"]

_EPS = 1e-6


def _loaded(fn: Any, types: Any, image: Any, loaded_hw: Any, *, encoded: bool, dev: str, antialias: bool) -> Any:
    """The loaded image (HWC uint8 on the graph's device) from encoded bytes or a loaded array."""
    if not encoded:
        return image.gpu() if dev == "gpu" else image
    decoded = fn.decoders.image(image, device="mixed" if dev == "gpu" else "cpu", output_type=types.RGB)
    # the YOLOv9 loaded resize; DALI has no INTER_AREA: antialiased linear (triangle) filter stands
    # for it (validation), plain linear is training's INTER_LINEAR
    return fn.resize(decoded, size=loaded_hw, interp_type=types.INTERP_LINEAR, antialias=antialias)


def _canvas(fn: Any, types: Any, dmath: Any, slots: list[tuple], out_hw: Any, fill: Any, *, dev: str) -> Any:
    """Paint one composed image (float HWC) from its slots ``(loaded image, *PLACEMENT)``."""
    canvas = None
    for loaded, part_box, crop_box, part_m, crop_m, kind, weight in slots:
        part = fn.slice(loaded, fn.cast(part_box[0:2], dtype=types.INT32), fn.cast(part_box[2:4], dtype=types.INT32),
                        axes=[0, 1], out_of_bounds_policy="trim_to_shape")
        crop = fn.slice(loaded, fn.cast(crop_box[0:2], dtype=types.INT32), fn.cast(crop_box[2:4], dtype=types.INT32),
                        axes=[0, 1], out_of_bounds_policy="trim_to_shape")
        pm = part_m.gpu() if dev == "gpu" else part_m
        cm = crop_m.gpu() if dev == "gpu" else crop_m
        ones_part = fn.cast(part[:, :, 0:1], dtype=types.FLOAT) * 0.0 + 1.0
        ones_crop = fn.cast(crop[:, :, 0:1], dtype=types.FLOAT) * 0.0 + 1.0
        w_img = fn.warp_affine(part, pm, size=out_hw, fill_value=0.0, dtype=types.FLOAT, interp_type=types.INTERP_LINEAR)
        w_cov = fn.warp_affine(ones_part, pm, size=out_hw, fill_value=0.0, interp_type=types.INTERP_LINEAR)
        w_rect = fn.warp_affine(ones_crop, cm, size=out_hw, fill_value=0.0, interp_type=types.INTERP_NN)
        value = kind * w_img + (1.0 - kind) * (w_img / dmath.max(w_cov, _EPS)) * w_rect
        cover = (kind * w_cov + (1.0 - kind) * w_rect) * weight
        value = value * weight
        if canvas is None:
            canvas = value + (1.0 - cover) * fill
        else:
            canvas = value + (1.0 - cover) * canvas
    return canvas


def build_pipeline(
    source: SampleSource,
    *,
    batch_size: int,
    device_id: int | None,
    workers: int,
    threads: int,
    prefetch: int,
    layout: Layout,
    seed: int = 0,
    antialias: bool = True,
) -> Any:
    """The DALI pipeline (not yet built) whose outputs are index, boxes, shapes, gain, decodes, attempt,
    damaged (CPU) then the uint8 images (HWC for ``layout="nhwc"``, CHW for ``"nchw"``).

    ``antialias``: shrink encoded images with the antialiased linear filter (INTER_AREA's stand-in,
    YOLOv9 validation) or, False, with plain linear interpolation (YOLOv9 training's INTER_LINEAR).
    """
    # optional dependency: only an engine="dali" loader builds a pipeline (DALIEngine checked it is installed)
    from nvidia.dali import fn, pipeline_def, types
    import nvidia.dali.math as dmath

    slots: TileSlots = source.slots
    encoded = source.encoded
    by_batch = source.by_batch
    dev = "cpu" if device_id is None else "gpu"

    @pipeline_def(batch_size=batch_size, num_threads=max(1, threads), device_id=device_id, seed=seed,
                  py_num_workers=max(1, workers), py_start_method="spawn", prefetch_queue_depth=max(1, prefetch))
    def graph():
        outs = fn.external_source(source, num_outputs=n_outputs(slots, by_batch), batch=False, parallel=True)
        head = dict(zip(HEAD, outs[: len(HEAD)]))
        rest = outs[len(HEAD):]
        tile_slots = []
        if by_batch:  # the sample's own image, loaded once; slots gather loaded images by batch position
            own = _loaded(fn, types, rest[0], rest[1], encoded=encoded, dev=dev, antialias=antialias)
            per = 1 + len(PLACEMENT)
            for k in range(slots.total):
                fields = rest[2 + per * k : 2 + per * (k + 1)]
                tile_slots.append((fn.permute_batch(own, indices=fields[0]),) + tuple(fields[1:]))
        else:  # every slot carries its own image
            per = 2 + len(PLACEMENT)
            for k in range(slots.total):
                fields = rest[per * k : per * (k + 1)]
                tile_slots.append((_loaded(fn, types, fields[0], fields[1], encoded=encoded, dev=dev, antialias=antialias),)
                                  + tuple(fields[2:]))
        out_hw = head["out_hw"]
        fill = head["fill"]
        main = _canvas(fn, types, dmath, tile_slots[: slots.main], out_hw, fill, dev=dev)
        main = dmath.floor(main + 0.5)
        if slots.mixup:
            other = _canvas(fn, types, dmath, tile_slots[slots.main :], out_hw, fill, dev=dev)
            other = dmath.floor(other + 0.5)
            r = head["ratio"]
            main = dmath.floor(main * r + other * (1.0 - r) + 1e-4)
        img = fn.cast(dmath.clamp(main, 0.0, 255.0), dtype=types.UINT8)
        img = fn.flip(img, horizontal=head["flip_lr"][0], vertical=head["flip_ud"][0])
        if layout == "nchw":
            img = fn.transpose(img, perm=[2, 0, 1])
        return tuple(head[k] for k in ("index", "boxes", "shapes", "gain", "decodes", "attempt", "damaged")) + (img,)

    return graph()
