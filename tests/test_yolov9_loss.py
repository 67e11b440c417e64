"""Loss and assigner: shapes, edge cases, and a short overfit on real coco128 images."""
from __future__ import annotations

import math

import pytest
import torch

from yolov9.assigner import TaskAlignedAssigner
from yolov9.boxes import bbox_iou
from yolov9.loss import DetectionLoss
from yolov9.models import DetectionModel, load_cfg
from yolov9.torch_utils import build_optimizer

# one intra-op thread: with two on a loaded 2-core machine the overfit below took 20 s in one suite run, 178 s in
# the next (threads spin-waiting for a core another process holds)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny(nc: int = 3, dual: bool = True) -> DetectionModel:
    cfg = load_cfg("yolov9-t.yaml" if dual else "gelan-t.yaml")
    cfg["width_multiple"] = 0.5
    return DetectionModel(cfg, nc=nc)


def test_ciou_identical_and_disjoint():
    a = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    assert bbox_iou(a, a, ciou=True).item() == pytest.approx(1.0, abs=1e-5)
    far = torch.tensor([[20.0, 20.0, 30.0, 30.0]])
    assert bbox_iou(a, far, ciou=True).item() < 0  # CIoU penalises centre distance below zero


def test_assigner_picks_anchors_inside_each_box():
    assigner = TaskAlignedAssigner(num_classes=2, topk=3)
    xs = torch.arange(8, dtype=torch.float32) * 8 + 4
    anchors = torch.stack(torch.meshgrid(xs, xs, indexing="xy"), -1).view(-1, 2)  # 64 anchors, stride 8
    a = anchors.shape[0]
    gt = torch.tensor([[[0.0, 0.0, 24.0, 24.0], [40.0, 40.0, 64.0, 64.0], [0.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[[0.0], [1.0], [0.0]]])
    mask = torch.tensor([[[1.0], [1.0], [0.0]]])
    pd_boxes = torch.cat((anchors - 6, anchors + 6), -1).unsqueeze(0)
    pd_scores = torch.full((1, a, 2), 0.5)
    t_labels, t_boxes, t_scores, fg, gt_idx = assigner(pd_scores, pd_boxes, anchors, labels, gt, mask)
    assert fg.sum() == 6  # top-3 for each of the two real boxes, none for the padding row
    for k in fg.nonzero()[:, 1]:
        box = gt[0, gt_idx[0, k]]
        p = anchors[k]
        assert box[0] < p[0] < box[2] and box[1] < p[1] < box[3]
        assert t_labels[0, k] == labels[0, gt_idx[0, k], 0]
    assert torch.all(t_scores[~fg] == 0) and torch.all(t_scores[fg].sum(-1) > 0)


@pytest.mark.parametrize("dual", [True, False])
def test_loss_finite_and_backprops(dual):
    model = _tiny(dual=dual)
    loss_fn = DetectionLoss(model, {"box": 7.5, "cls": 0.5, "dfl": 1.5})
    imgs = torch.rand(2, 3, 96, 128)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4], [1, 2, 0.3, 0.3, 0.2, 0.2], [1, 0, 0.7, 0.6, 0.2, 0.5]])
    loss, items = loss_fn(model(imgs), targets)
    assert torch.isfinite(loss) and items.shape == (3,) and torch.all(items > 0)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # no targets at all: only the classification term remains
    loss0, items0 = loss_fn(model(imgs), torch.zeros(0, 6))
    assert torch.isfinite(loss0) and items0[0] == 0 and items0[2] == 0 and items0[1] > 0


def test_aux_branch_weight_and_gains():
    model = _tiny()
    imgs = torch.rand(1, 3, 64, 64)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.5, 0.5]])
    preds = model(imgs)
    base = DetectionLoss(model, {"box": 1.0, "cls": 1.0, "dfl": 1.0})
    aux_only = base._branch(preds[0], targets)
    main_only = base._branch(preds[1], targets)
    _, items = base(preds, targets)
    torch.testing.assert_close(items, 0.25 * aux_only.detach() + main_only.detach())
    _, doubled = DetectionLoss(model, {"box": 2.0, "cls": 1.0, "dfl": 1.0})(preds, targets)
    assert doubled[0] == pytest.approx(2 * items[0].item(), rel=1e-5)


def test_loss_falls_on_coco128(coco128_yaml):
    """24 CPU steps of GELAN-T at depth 0.34 (one RepNCSP repeat in each RepNCSPELAN4: a quarter less CPU than
    the full depth) on 4 real images at 128: the loss stays finite and falls clearly (the mean of the last five
    steps is 0.29-0.35 of the first five's with seeds 0-2, against the 0.6 asserted; 0.26-0.32 at 160, which cost
    4.7-6.3 s of CPU against 3.8 s at 128; at 96 the margin narrows to 0.36-0.45)."""
    import fastload

    with fastload.loader(coco128_yaml, split="train", imgsz=128, batch_size=4, augment=False, shuffle=False,
                         workers=0) as loader:
        imgs, targets, _, _ = next(iter(loader))
        imgs = imgs.float().div(255).contiguous()
        targets = targets.clone()
    assert targets.shape[0] > 0
    torch.manual_seed(0)
    cfg = load_cfg("gelan-t.yaml")
    cfg["depth_multiple"] = 0.34
    model = DetectionModel(cfg, nc=80)
    loss_fn = DetectionLoss(model, {"box": 7.5, "cls": 0.5, "dfl": 1.5})
    opt = build_optimizer(model, "AdamW", lr=2e-3, momentum=0.9, decay=0.0)
    losses = []
    model.train()
    for _ in range(24):
        loss, _ = loss_fn(model(imgs), targets)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
