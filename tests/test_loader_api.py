"""fastload.loader(): batch format, length, epochs, close_mosaic, rect, filtering, determinism."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import fastload
from fastload.fastloader import loader

IMGSZ = 128


def batches(fl, n=None):
    out = []
    for k, (imgs, targets, paths, shapes) in enumerate(fl):
        out.append((imgs.clone(), targets.clone(), paths, shapes))
        if n is not None and k + 1 == n:
            break
    return out


def test_batch_format_feeds_a_training_step(synth_yaml):
    with fastload.loader(synth_yaml, imgsz=IMGSZ, batch_size=8, workers=1, store="files") as fl:
        imgs, targets, paths, shapes = next(iter(fl))
    assert imgs.dtype == torch.uint8 and imgs.shape == (8, 3, IMGSZ, IMGSZ)
    assert targets.dtype == torch.float32 and targets.ndim == 2 and targets.shape[1] == 6
    assert len(paths) == 8 and all(isinstance(p, str) for p in paths)
    assert len(shapes) == 8
    if len(targets):
        assert targets[:, 0].min() >= 0 and targets[:, 0].max() < 8
        assert (targets[:, 2:] >= 0).all() and (targets[:, 2:] <= 1).all()
        assert (targets[:, 4:] > 0).all()
    # what the YOLOv9 trainer does with it
    x = imgs.to("cpu", non_blocking=True).float() / 255
    conv = torch.nn.Conv2d(3, 4, 3, stride=2)
    loss = conv(x).sum() + 0 * targets.sum()
    loss.backward()
    assert conv.weight.grad is not None and torch.isfinite(conv.weight.grad).all()


def test_len_epochs_and_drop_last(synth_yaml):
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=5, workers=0, augment=False, store="files") as fl:
        n = fl.dataset.n
        assert len(fl) == -(-n // 5)
        b0 = batches(fl)
        assert len(b0) == len(fl)
        assert sorted(p for b in b0 for p in b[2]) == sorted(fl.dataset.im_files)
        b1 = batches(fl)  # the next epoch: another permutation
        assert [b[2] for b in b0] != [b[2] for b in b1]
        fl.set_epoch(0)
        assert [b[2] for b in batches(fl)] == [b[2] for b in b0]
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=5, workers=0, augment=False, store="files", drop_last=True) as fl:
        assert len(fl) == n // 5
        assert all(len(b[2]) == 5 for b in batches(fl))


@pytest.mark.parametrize("partners", ["dataset", "batch", "recent"])
def test_same_seed_same_batches_for_0_1_2_workers(synth_yaml, partners):
    """With partners="batch" a record also depends on its batch's composition, which depends on the
    seed, the epoch and the batch size only: the same for any worker count (there with the decode
    cache off: every worker decodes what its batches read, at most once per output image); with "recent"
    on the epoch order, whichever worker renders the sample."""
    runs = []
    options = {"decode_cache_mb": 0} if partners == "batch" else None
    for w in (0, 1, 2):
        with loader(synth_yaml, imgsz=IMGSZ, batch_size=6, workers=w, seed=3, store="files", partners=partners,
                    engine_options=options) as fl:
            runs.append(batches(fl))
            stats = fl.stats()
            assert stats["partners"] == partners
            if partners == "batch":
                assert 0 < stats["decodes"] <= stats["images"] == fl.dataset.n
            if partners == "recent":  # its window is over the loader's own epoch order, which a table would change
                window = fl.engine.sampler.recent(0, int(fl.epoch_order(0)[9]))
                assert window.tolist() == fl.epoch_order(0)[:10].tolist()
                with pytest.raises(ValueError, match="partners='recent' draws mosaic partners from"):
                    fl.set_image_table(np.zeros(fl.n, np.int64))
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=6, workers=0, seed=4, store="files", partners=partners) as fl:
        assert not torch.equal(batches(fl, 1)[0][0], runs[0][0][0])


def test_batch_partners_with_an_image_table(synth_yaml):
    """--image-weights' table repeats images (sample ids): partners come from the images the batch
    shows, each loaded once, the same for 0 and 2 workers."""
    runs = []
    for w in (0, 2):
        with loader(synth_yaml, imgsz=IMGSZ, batch_size=6, workers=w, seed=3, store="files", partners="batch",
                    engine_options={"decode_cache_mb": 0}) as fl:
            table = np.random.default_rng(0).integers(0, fl.n, fl.n)  # with repeats
            fl.set_image_table(table)
            runs.append(batches(fl))
            stats = fl.stats()
            assert 0 < stats["decodes"] <= stats["images"]  # at most once per batch image, repeats included
    for a, b in zip(*runs):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("shuffle", [True, False])
def test_next_epoch_started_early_gives_the_same_batches(synth_yaml, shuffle):
    """Workers begin the next epoch's first batches while an epoch ends. The batches equal those
    rendered in-process; work for a wrongly guessed epoch (set_epoch jumps, close_mosaic between
    epochs, an abandoned epoch) is dropped, not served."""
    plan = [None, None, 7, "close", None, "part", None]  # auto 0 -> 1, jump to 7, close mosaic, ...

    def run(workers):
        out = []
        with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=workers, seed=5, store="files", shuffle=shuffle) as fl:
            for step in plan:
                if step == "close":
                    fl.close_mosaic()
                elif step == "part":
                    out.append(batches(fl, 1))
                else:
                    if step is not None:
                        fl.set_epoch(step)
                    out.append(batches(fl))
            return out, fl.stats()

    want, _ = run(0)
    got, stats = run(2)
    assert [len(e) for e in got] == [len(e) for e in want] and len(want[0]) >= 3
    for e_want, e_got in zip(want, got):
        for a, b in zip(e_want, e_got):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]
    assert stats["early_batches_used"] > 0 and stats["early_batches_dropped"] > 0
    assert all(s is not None for b in got[3] for s in b[3])  # mosaic closed from the 4th epoch on


def test_close_mosaic_via_method_dataset_flag_and_epochs(synth_yaml):
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=8, workers=1, store="files") as fl:
        first = batches(fl)
        assert any(s is None for b in first for s in b[3])  # mosaic samples
        assert fl.dataset.mosaic
        fl.dataset.mosaic = False  # what YOLOv9 train_dual.py does
        assert not fl.dataset.mosaic
        for b in batches(fl):
            assert all(s is not None for s in b[3])
            assert b[0].shape[-2:] == (IMGSZ, IMGSZ)
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=8, workers=0, store="files", close_mosaic=2, epochs=5) as fl:
        fl.set_epoch(2)
        assert not fl.mosaic_closed
        fl.set_epoch(3)
        assert fl.mosaic_closed
        assert all(s is not None for b in batches(fl) for s in b[3])


def test_rect_validation_batches(synth_yaml):
    kw = dict(split="val", imgsz=IMGSZ, batch_size=3, augment=False, rect=True, pad=0.5, store="files")
    with loader(synth_yaml, workers=1, **kw) as fl:
        ds = fl.dataset
        out = batches(fl)
        again = batches(fl)
        assert len(out) == len(fl) == -(-ds.n // 3)
        assert [b[2] for b in out] == [b[2] for b in again]  # no shuffle
        hw = {p: tuple(ds.hw[i]) for i, p in enumerate(ds.im_files)}
        aspects = [hw[p][0] / hw[p][1] for b in out for p in b[2]]
        assert aspects == sorted(aspects)
        for k, b in enumerate(out):
            h, w = b[0].shape[-2:]
            assert h % 32 == 0 and w % 32 == 0 and max(h, w) <= IMGSZ + 32
            assert (h, w) == tuple(ds.batch_shapes[k])
            for (h0, w0), ((rh, rw), (pw, ph)) in b[3]:
                assert pw >= 0 and ph >= 0
        assert len({tuple(b[0].shape[-2:]) for b in out}) > 1  # shapes differ between batches
    with loader(synth_yaml, workers=0, **kw) as fl0:
        for a, b in zip(out, batches(fl0)):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_min_items_and_single_cls(synth_yaml):
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, augment=False, store="files") as fl:
        n_all = fl.dataset.n
        counts = [len(lb) for lb in fl.dataset.labels]
    assert min(counts) == 0  # the synthetic set has empty-label images
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, augment=False, store="files", min_items=2) as fl:
        assert fl.dataset.n == sum(c >= 2 for c in counts) < n_all
        assert all(len(lb) >= 2 for lb in fl.dataset.labels)
        assert len(fl.dataset.labels) == len(fl.dataset.im_files) == len(fl.dataset.shapes)
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=8, workers=1, store="files", single_cls=True) as fl:
        assert all((lb[:, 0] == 0).all() for lb in fl.dataset.labels if len(lb))
        t = torch.cat([b[1] for b in batches(fl)])
        assert len(t) and (t[:, 1] == 0).all()


def test_validation_targets_match_labels_including_empty(synth_yaml):
    """Without augmentation every label survives (boxes move, counts do not) and empty images add none."""
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, augment=False, shuffle=False, store="files") as fl:
        ds = fl.dataset
        row = {p: i for i, p in enumerate(ds.im_files)}
        for imgs, targets, paths, shapes in fl:
            for k, p in enumerate(paths):
                lb = ds.labels[row[p]]
                got = targets[targets[:, 0] == k]
                assert len(got) == len(lb)
                if len(lb):
                    assert np.array_equal(got[:, 1].numpy(), lb[:, 0])
                h0, w0 = shapes[k][0]
                assert (h0, w0) == tuple(ds.hw[row[p]])


def test_odd_images_grayscale_rgba_large_small(synth_yaml):
    """All synthetic oddities (97x313 ... 1280x720, grayscale and RGBA PNGs) go through both modes."""
    with loader(synth_yaml, imgsz=64, batch_size=24, workers=0, store="files") as fl:
        imgs, targets, paths, _ = next(iter(fl))
        assert imgs.shape == (24, 3, 64, 64)
        assert any(p.endswith(".png") for p in fl.dataset.im_files)
    with loader(synth_yaml, imgsz=800, batch_size=4, workers=0, augment=False, store="files") as fl:
        for imgs, _, _, _ in fl:
            assert imgs.shape[1:] == (3, 800, 800)


def test_dataset_attributes_for_trainer(synth_yaml):
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, store="files") as fl:
        ds = fl.dataset
        assert ds.n == len(ds.labels) == len(ds.im_files) == len(ds.label_files) == len(ds.shapes)
        assert ds.names == ["square", "circle", "triangle"][: len(ds.names)] or len(ds.names) == 3
        assert all(f.endswith(".txt") and "/labels/" in f for f in ds.label_files)
        np.testing.assert_array_equal(ds.shapes, ds.hw[:, ::-1])  # YOLOv9 keeps (w, h)
        labels = np.concatenate(ds.labels, 0)
        assert labels.shape[1] == 5 and int(labels[:, 0].max()) < 3
        with pytest.raises(TypeError):
            ds[0]
        assert "FastLoader" in repr(fl)


def test_bad_arguments(synth_yaml):
    with pytest.raises(ValueError, match="engine"):
        loader(synth_yaml, engine="nope", store="files")
    with pytest.raises(ValueError, match="hsv_on"):
        loader(synth_yaml, hsv_on="gpu", store="files")
    with pytest.raises(ValueError, match="no images left"):
        loader(synth_yaml, store="files", min_items=10**6)
    with pytest.raises(ValueError, match="engine 'cpu': axis_kernel"):
        loader(synth_yaml, store="files", engine_options={"axis_kernel": "cubic"})
    with pytest.raises(TypeError, match="engine 'gpu' has no option 'axis_kernel' \\(an option of engines 'cpu' and 'ray'\\)"):
        loader(synth_yaml, store="files", engine="gpu", engine_options={"axis_kernel": "warp"})


def test_ultralytics_recipe_renders_on_the_cpu_engine_and_is_refused_elsewhere(synth_yaml):
    """recipe="ultralytics": rendered by the cpu engine's workers (the same batches for 0 and 1 workers,
    other than YOLOv9's), its HSV on the consumer within one level of the workers'; the DALI engine and
    deferred HSV, which have no additive-hue kernel, are refused in one line."""
    runs = []
    for recipe, w, hsv in (("ultralytics", 0, "worker"), ("ultralytics", 1, "worker"), ("yolov9", 0, "worker"),
                           ("ultralytics", 0, "consumer")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # hsv_on='consumer' without a GPU: slow, says a warning
            with loader(synth_yaml, imgsz=IMGSZ, batch_size=6, workers=w, seed=2, store="files", recipe=recipe,
                        hsv_on=hsv) as fl:
                runs.append(batches(fl, 1)[0])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])
    assert int((runs[0][0].int() - runs[3][0].int()).abs().max()) <= 1
    with pytest.raises(ValueError, match=r"recipe='ultralytics' \(additive-hue HSV\) is applied in the workers or on") as e:
        loader(synth_yaml, store="files", recipe="ultralytics", hsv_on="defer")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="recipe must be one of yolov9, ultralytics"):
        loader(synth_yaml, store="files", recipe="v8")


@pytest.mark.parametrize("kw, says", [
    (dict(imgsz=300), r"imgsz must be a positive multiple of the stride 32, got 300; use e.g. 288"),
    (dict(imgsz=0), r"imgsz must be a positive multiple of the stride 32, got 0; use e.g. 32"),
    (dict(imgsz=96, stride=64), r"multiple of the stride 64, got 96"),
    (dict(workers=-1), r"workers must be >= 0 \(0 renders in the calling process\), got -1"),
])
def test_imgsz_and_workers_are_checked_first(synth_yaml, kw, says):
    """A model cannot take 300x300 batches (its feature maps of stride 8..32 would not line up): refused,
    as are sizes and worker counts that mean nothing."""
    with pytest.raises(ValueError, match=says):
        loader(synth_yaml, store="files", **kw)


def test_axis_kernel_reaches_the_workers(synth_yaml):
    """Both tile kernels, rendered by 2 workers, equal the in-process render of the same kernel; the
    two kernels give different, close pixels and identical boxes."""
    runs = {}
    for kernel in ("warp", "resize"):
        for w in (0, 2):
            with loader(synth_yaml, imgsz=IMGSZ, batch_size=6, workers=w, seed=3, store="files",
                        engine_options={"axis_kernel": kernel}) as fl:
                runs[kernel, w] = batches(fl, 2)
    for kernel in ("warp", "resize"):
        for a, b in zip(runs[kernel, 0], runs[kernel, 2]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for a, b in zip(runs["warp", 0], runs["resize", 0]):
        d = (a[0].int() - b[0].int()).abs().float()
        assert 0 < d.mean() < 1.0
        assert torch.equal(a[1], b[1])


def test_hsv_consumer_and_defer_match_worker(synth_yaml):
    from fastload.augment.functional.torch_ops import apply_hsv_batch

    kw = dict(imgsz=64, batch_size=6, seed=5, store="files")
    with loader(synth_yaml, workers=1, hsv_on="worker", **kw) as fl:
        ref = batches(fl, 2)
    with pytest.warns(UserWarning, match="consumer"), loader(synth_yaml, workers=1, hsv_on="consumer", **kw) as fl:
        cons = batches(fl, 2)
    with loader(synth_yaml, workers=0, hsv_on="defer", **kw) as fl:
        deferred = []
        for k, b in enumerate(fl):
            assert fl.hsv_gains.shape == (6, 3)
            deferred.append(apply_hsv_batch(b[0], fl.hsv_gains))
            if k == 1:
                break
    for r, c, d in zip(ref, cons, deferred):
        assert (r[0].int() - c[0].int()).abs().max() <= 1
        assert torch.equal(c[0], d)
        assert torch.equal(r[1], c[1])
    assert not torch.equal(ref[0][0], batches_nohsv(synth_yaml, kw))


def batches_nohsv(synth_yaml, kw):
    with loader(synth_yaml, workers=0, hsv_on="defer", **kw) as fl:
        return batches(fl, 1)[0][0]


def test_image_table_repeats_images_with_their_own_draws_for_any_worker_count(synth_yaml):
    """dataset.indices (YOLOv9 --image-weights): position p shows image table[p]; a repeated image gets
    its own augmentation; the batches are the same for 0 and 2 workers."""
    kw = dict(imgsz=64, batch_size=4, seed=3, store="files")
    runs = []
    for workers in (0, 2):
        with loader(synth_yaml, workers=workers, **kw) as fl:
            assert fl.num_workers == workers
            n = fl.dataset.n
            assert list(fl.dataset.indices) == list(range(n))
            table = [1] * (n // 2) + list(range(n - n // 2))  # image 1 at least n/2 + 1 times
            fl.dataset.indices = table
            assert fl.dataset.indices == table
            got = batches(fl)
            runs.append(got)
    a, b = runs
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
    paths = [p for batch in a for p in batch[2]]
    with loader(synth_yaml, workers=0, **kw) as fl:
        files = fl.dataset.im_files
    assert sorted(paths) == sorted(files[i] for i in table)  # the table's multiset, shuffled
    ones = [k for k, p in enumerate(paths) if p == files[1]]
    imgs = torch.cat([batch[0] for batch in a])
    assert len(ones) > 1 and not torch.equal(imgs[ones[0]], imgs[ones[1]])  # repeats are augmented anew


def test_image_table_errors(synth_yaml):
    with loader(synth_yaml, imgsz=64, batch_size=4, workers=0, store="files") as fl:
        with pytest.raises(ValueError, match="one image index per position"):
            fl.dataset.indices = [0, 1]
        with pytest.raises(ValueError, match="outside"):
            fl.dataset.indices = [fl.dataset.n] * fl.dataset.n
        fl.dataset.indices = range(fl.dataset.n)  # the plain order again
        assert fl.image_table is None
    with loader(synth_yaml, imgsz=64, batch_size=4, workers=0, store="files", rect=True, augment=False) as fl:
        with pytest.raises(ValueError, match="rect"):
            fl.dataset.indices = [0] * fl.dataset.n


def test_pad_without_rect_is_refused_and_the_dataset_shows_its_loader(synth_yaml):
    with pytest.raises(ValueError, match="pad=0.5 pads rect batch shapes and applies only with rect=True"):
        loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, store="files", pad=0.5)
    with loader(synth_yaml, imgsz=IMGSZ, batch_size=4, workers=0, store="files", augment=False, rect=True, pad=0.5) as fl:
        assert fl.dataset.pad == 0.5 and fl.dataset.rect
        fl.dataset.indices = list(range(fl.n))  # the dataset reaches its own loader from the start
        assert fl.image_table is None and list(fl.dataset.indices) == list(range(fl.n))
        assert len(fl.sampler) == fl.n and sorted(fl.sampler) == list(range(fl.n))


def test_the_jpeg_decoder_is_an_engine_option(synth_yaml, monkeypatch):
    """CPUOptions/RayOptions(jpeg_decoder=...) decodes that loader's JPEGs with that decoder, whatever the
    process's choice (set_jpeg_decoder, $FASTLOAD_JPEG_DECODER); a name that is no decoder is refused."""
    from fastload.data import images
    from fastload.engines.base import EngineOptionError

    used = {name: 0 for name in images.JPEG_DECODERS}
    for name, fn in list(images._JPEG_DECODERS.items()):
        def counted(buf, flags, _fn=fn, _name=name):
            used[_name] += 1
            return _fn(buf, flags)
        monkeypatch.setitem(images._JPEG_DECODERS, name, counted)
    kw = dict(imgsz=IMGSZ, batch_size=4, workers=0, store="files", seed=2)
    with loader(synth_yaml, **kw, engine_options={"jpeg_decoder": "pil", "decode_cache_mb": 0}) as fl:
        with_option = [b[0].clone() for b in fl]
    assert used["pil"] > 0 and used["cv2"] == used["torchvision"] == 0
    monkeypatch.setenv("FASTLOAD_JPEG_DECODER", "pil")  # the process's choice, the same decoder
    with loader(synth_yaml, **kw, engine_options={"decode_cache_mb": 0}) as fl:
        process_wide = [b[0].clone() for b in fl]
    assert all(torch.equal(a, b) for a, b in zip(with_option, process_wide))
    monkeypatch.delenv("FASTLOAD_JPEG_DECODER")
    used.update(pil=0)
    with loader(synth_yaml, **kw, engine_options={"decode_cache_mb": 0}) as fl:
        next(iter(fl))
    assert used["pil"] == 0 and used["cv2"] > 0  # without the option: the process's default, cv2
    with pytest.raises(EngineOptionError, match="jpeg_decoder must be None or one of cv2, torchvision, pil, got 'nvjpeg'"):
        loader(synth_yaml, **kw, engine_options={"jpeg_decoder": "nvjpeg"})


def test_default_partners_follow_the_decoded_cache(synth_yaml, shm_root):
    """partners=None keeps YOLOv9's draw while the decoded set fits the machine's decoded cache and draws from the
    batch once it does not (one decode per output image at most, not about 4.6), saying so in repr and stats; the
    planned "batch" gives partners="batch"'s batches, and partners="dataset" still gets today's plan and batches."""
    kw = dict(imgsz=192, batch_size=6, workers=0, seed=2, store="files")
    small = {"decode_cache_mb": 1}  # the 24 images need 1.6 MB loaded at 192
    runs, stats = {}, {}
    for name, extra in (("planned-small", dict(engine_options=small)),
                        ("batch-small", dict(partners="batch", engine_options=small)),
                        ("dataset-small", dict(partners="dataset", engine_options=small)),
                        ("planned-fits", {})):
        with loader(synth_yaml, **kw, **extra) as fl:
            runs[name], stats[name], text = batches(fl), fl.stats(), repr(fl)
        if name == "planned-small":
            assert "partners=batch (the decoded set, " in text and "exceeds the decode cache, 1.0 MB)" in text
        if name == "planned-fits":
            assert "partners=dataset (the decoded set, " in text and "fits the decode cache" in text
    plans = {name: (s["partners"], s["partners_by"]) for name, s in stats.items()}
    assert plans == {"planned-small": ("batch", "cache-too-small"), "batch-small": ("batch", "caller"),
                     "dataset-small": ("dataset", "caller"), "planned-fits": ("dataset", "cache-fits")}
    assert stats["planned-small"]["decodes"] <= stats["planned-small"]["images"] == 24
    assert stats["dataset-small"]["decodes"] > 1.5 * 24  # many partners are images the cache has no place for
    for a, b in (("planned-small", "batch-small"), ("dataset-small", "planned-fits")):
        assert len(runs[a]) == len(runs[b]) == 4
        for x, y in zip(runs[a], runs[b]):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
    assert not torch.equal(runs["planned-small"][0][0], runs["planned-fits"][0][0])
