"""The DALI engine (``engine="dali"``): NVIDIA DALI decodes and augments; the CPU only reads and plans.

Worker processes of a parallel, per-sample ``fn.external_source``
(:class:`~fastload.engines.dali_source.SampleSource`) read the encoded bytes (LMDB, files) or the
loaded arrays (disk, ram) of every image a sample draws from, draw the sample's record with the
same :class:`~fastload.augment.params.ParamSampler` as the other engines (same seed, epoch and
index -> same record) and compute its boxes with :func:`fastload.augment.boxes.transform_labels`.
The graph (:mod:`fastload.engines.dali_graph`) decodes with ``fn.decoders.image(device="mixed")``,
resizes, paints the tiles with ``fn.warp_affine``, blends mixup and flips (and, for
``layout="nchw"``, transposes to CHW); the engine collates the boxes into targets (pinned, copied
without blocking) and hands the HSV gains to the shared finishing step, which applies them to the
output batch with :func:`~fastload.augment.functional.torch_ops.apply_hsv_batch` (YOLOv9's
multiplicative hue has no DALI operator) unless ``hsv_on="defer"``.

CPU-only mode (``device="cpu"``): the same graph with ``device_id=None`` and every operator on the
CPU. It is slow and meant for tests and machines without a GPU.

Epochs: before DALI epoch ``k`` the engine writes ``plan_k.npz`` (our epoch number, the ordered
indices padded to whole batches, the close-mosaic switch) to a private folder; the workers read it
(they are separate processes holding copies of the sampler). An abandoned epoch rebuilds the
pipeline.

Tolerance against the CPU reference (see ``tests/test_engine_dali.py``): boxes identical; pixels
from decoded stores within a few levels at tile seams (DALI's float bilinear vs OpenCV's fixed
point, renormalised edge taps); from encoded stores DALI's antialiased linear resize replaces
validation's INTER_AREA (a small mean difference, larger on noisy images than on photos; the test states
the bounds); training shrinks with plain linear interpolation, as YOLOv9's INTER_LINEAR.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Generator

import numpy as np
import torch

from fastload.augment.params import ParamSampler, shapes_from_array
from fastload.data.device import resolve_device
from fastload.engines.base import Batch, Engine, EngineOptionError, EngineSettings, Rendered, chunks, collate_targets
from fastload.engines.dali_graph import build_pipeline
from fastload.engines.dali_source import SampleSource, TileSlots, write_plan
from fastload.engines.main_guard import unguarded_main_line
from fastload.store.base import DamagedRecordError, Store

__all__ = ["DALIEngine", "DALIOptions", "require_dali"]

INSTALL_HINT = "pip install fastload[dali]  (or: pip install nvidia-dali-cuda120; see https://docs.nvidia.com/deeplearning/dali)"


def require_dali() -> Any:
    """Import ``nvidia.dali`` or raise ImportError saying how to install it."""
    try:  # an optional dependency (pip install fastload[dali])
        import nvidia.dali as dali  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"engine='dali' needs NVIDIA DALI, which is not installed ({exc}). Install it with: {INSTALL_HINT}") from None
    return dali


def _device_id(device: str | torch.device | None) -> tuple[int | None, torch.device]:
    """DALI's ``device_id`` (None: its CPU-only mode) and the device batches are delivered on."""
    dev = resolve_device(device, "engine='dali'", instead="device='cpu' for DALI's CPU-only mode, or engine='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"engine='dali' supports device='cpu' or a CUDA device, got {device!r}")
    return dev.index, dev


def _refuse_unguarded_script() -> None:
    """Fail at once, saying what to do, where DALI's spawned workers would re-run the script and hang."""
    unguarded = unguarded_main_line()
    if unguarded:
        script, line = unguarded
        raise RuntimeError(
            f"engine='dali' starts its reader processes with 'spawn', which runs {script} again from the top, and "
            f"line {line} builds the loader outside `if __name__ == \"__main__\":`; move the script's work under that "
            f"guard (docs/gpu.md, \"DALI needs a main guard\")"
        )


def _max_tiles(sampler: ParamSampler) -> int:
    return 9 if sampler.mosaic9 else 4


@dataclass(frozen=True)
class DALIOptions:
    """Options of ``engine="dali"`` (``loader(..., engine_options=DALIOptions(...))`` or a dict of them).

    Attributes:
        threads: DALI's CPU operator threads (``None``: ``max(2, workers)``).
    """

    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise EngineOptionError(f"engine 'dali': threads must be None or >= 1, got {self.threads}")


class DALIEngine(Engine):
    """Batches decoded and augmented by an NVIDIA DALI pipeline (options: :class:`DALIOptions`).

    Settings: ``workers`` external-source worker processes (at least 1); ``prefetch``: DALI's
    prefetch queue depth (at least 1); ``hsv_on="consumer"`` (the default) applies HSV to the output batch
    on ``device``, ``"defer"`` hands the gains over; ``"worker"`` is refused (the graph has no HSV step);
    ``layout="nhwc"`` skips the
    graph's transpose (``imgs`` is a channels-last view), ``"nchw"`` transposes in the graph.
    :meth:`close_mosaic` takes effect from the next epoch: the workers hold their own sampler copies
    and learn it from the next plan. Batches are fresh tensors, the caller's to keep (``batches_copied`` stays 0).

    Default ``partners="batch"``: a per-sample external source cannot share a decoded image between
    samples, so with ``"dataset"`` the graph decodes and resizes the image of every tile slot of
    every sample (about 4.6 decodes per output image with scratch-high, on every epoch: this engine
    has no decoded-image cache, and device memory is the model's). With ``"batch"`` each sample's
    own image is decoded once and the tiles are gathered from the batch with ``fn.permute_batch``,
    the way DALI's own YOLO mosaic example builds mosaics. What changes for the user: a mosaic's
    three partners and the mixup image with its partners are drawn uniformly from the ``B`` images
    of the same batch instead of all ``N`` of the dataset; every image is still used as often per
    epoch on average, with the same spread (``tests/test_augment_params.py``), but the tiles of one
    batch come from its own ``B`` images. Pass ``partners="dataset"`` for YOLOv9's own draw.
    """

    name = "dali"
    Options = DALIOptions
    min_workers = 1  # samples are read in external-source worker processes
    min_prefetch = 1  # DALI's prefetch queue holds at least one batch
    renders_on = "device"
    # HSV is applied to the output batch by the shared finishing step: there is no earlier place for it
    # (YOLOv9's multiplicative hue has no DALI operator), so "worker" would silently mean "consumer"
    hsv_modes = ("consumer", "defer")
    default_workers = 8
    default_partners = "batch"
    requires = "nvidia.dali"

    def __init__(self, store: Store, sampler: ParamSampler, settings: EngineSettings, options: DALIOptions | None = None) -> None:
        require_dali()
        _refuse_unguarded_script()
        super().__init__(store, sampler, settings, options)
        self.device_id, self.device = _device_id(settings.device)
        self.imgsz = int(sampler.imgsz)
        k = _max_tiles(sampler)
        # slots are sized once, for the largest record the sampler can draw before close_mosaic
        mixup = k if float(sampler.mixup_prob) > 0 and float(sampler.mosaic_prob) > 0 else 0
        self.slots = TileSlots(k if sampler.mosaic_prob > 0 else 1, mixup)
        self.threads = int(self.options.threads or max(2, self.workers))
        self.prefetch = int(settings.prefetch)
        self._dir = tempfile.mkdtemp(prefix="fastload-dali-")
        self._source = SampleSource(store, sampler, self._dir, self.slots, self.imgsz, encoded=not store.decoded,
                                    batch_size=self.batch_size)
        self._pipe: Any = None
        self._epochs = 0  # DALI epochs run by the current pipeline
        self._clean = True  # the current pipeline finished its last epoch

    # -- pipeline ----------------------------------------------------------------------------------------
    def _build(self) -> Any:
        self._drop_pipe()
        pipe = build_pipeline(self._source, batch_size=self.batch_size, device_id=self.device_id,
                              workers=self.workers, threads=self.threads, prefetch=self.prefetch,
                              layout=self.settings.layout, antialias=self.shrink == "area")
        try:
            with warnings.catch_warnings():
                # decoded stores do not use the loaded-size outputs (encoded ones do)
                warnings.filterwarnings("ignore", message=".*outputs? at the ind(ex|ices) .* (is|are) not used.*")
                pipe.build()
        except RuntimeError as exc:
            msg = str(exc)
            if any(w in msg for w in ("CUDA", "cuda", "driver", "nvJPEG", "nvjpeg")):
                raise RuntimeError(
                    f"DALI could not start on {self.device}: {msg.splitlines()[0] if msg else exc!r}. This usually means the "
                    f"DALI wheel does not match the CUDA driver/runtime (torch reports CUDA {torch.version.cuda}); install the "
                    f"matching nvidia-dali-cudaXXX wheel ({INSTALL_HINT}) or use engine='gpu'"
                ) from exc
            raise
        self._pipe = pipe
        self._epochs = 0
        self._clean = True
        return pipe

    def _drop_pipe(self) -> None:
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            try:
                pipe._shutdown_workers() if hasattr(pipe, "_shutdown_workers") else None
            except Exception:
                pass
            del pipe

    # -- batches -----------------------------------------------------------------------------------------
    def _render_batches(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        return self._iter(epoch, indices)

    def _iter(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        n = len(indices)
        if n == 0:
            return
        if self._pipe is None or not self._clean:
            self._build()
        # pad to whole batches (DALI batches are fixed-size); padded samples are dropped below
        # (repeating the last index keeps a rect batch's output size)
        padded = np.concatenate([indices, np.full(-n % self.batch_size, indices[-1], np.int64)])
        write_plan(self._dir, self._epochs, epoch, padded, n, self.mosaic_closed)
        self._clean = False
        pipe = self._pipe
        for b, idx in enumerate(chunks(indices, self.batch_size)):
            outs = pipe.run()
            yield self._rendered(outs, len(idx))
        try:  # the source raises StopIteration after the last padded sample: end DALI's epoch
            pipe.run()
            raise RuntimeError("DALI pipeline produced more batches than planned")
        except StopIteration:
            pipe.reset()
        self._epochs += 1
        self._clean = True

    def _rendered(self, outs: tuple, n: int) -> Rendered:
        index_tl, boxes_tl, shapes_tl, gain_tl, decodes_tl, attempt_tl, damaged_tl, img_tl = outs
        self.decodes += sum(int(np.asarray(decodes_tl[k])[0]) for k in range(len(decodes_tl)))  # padding included
        found = [f for k in range(len(damaged_tl)) for f in json.loads(np.asarray(damaged_tl[k]).tobytes())]
        if found and self.settings.strict:  # the sources never raise: strict is applied here, in the consumer
            raise DamagedRecordError.from_fields(found[0])
        self._note_damage(found, sum(int(np.asarray(attempt_tl[k])[0]) > 0 for k in range(n)))
        index = [int(np.asarray(index_tl[k])[0]) for k in range(n)]
        boxes = [np.asarray(boxes_tl[k]).reshape(-1, 5) for k in range(n)]
        shapes = tuple(shapes_from_array(np.asarray(shapes_tl[k])) for k in range(n))
        gains = torch.from_numpy(np.stack([np.asarray(gain_tl[k]) for k in range(n)]).astype(np.float32))
        imgs = self._images(img_tl, n)
        targets = torch.from_numpy(collate_targets(boxes))
        if self.device.type == "cuda":
            targets = targets.pin_memory().to(self.device, non_blocking=True)
        paths = tuple(self.store.im_files[i] for i in index)
        return Rendered(Batch(imgs, targets, paths, shapes), gains)

    def _images(self, tl: Any, n: int) -> torch.Tensor:
        """The DALI image batch as a uint8 [n, 3, H, W] tensor on the engine's device (a channels-last
        view of the graph's HWC output for ``layout="nhwc"``)."""
        if self.device_id is None:
            out = torch.from_numpy(np.ascontiguousarray(tl.as_array()[:n]))
        else:
            from nvidia.dali.plugin.pytorch import feed_ndarray  # optional dependency, present once DALI runs

            dense = tl.as_tensor()
            out = torch.empty(tuple(dense.shape()), dtype=torch.uint8, device=self.device)
            # copies on torch's current stream: ordered before the training step, no host sync
            feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(self.device))
            out = out[:n]
        return out.permute(0, 3, 1, 2) if self.settings.layout == "nhwc" else out

    def _release(self) -> None:
        self._drop_pipe()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
