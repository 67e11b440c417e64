"""Building blocks of YOLOv9 / GELAN networks (written from the published architecture).

Every block takes its input channel count first, as the YAML parser passes it, then the output
channels and the block's own arguments. Convolutions are ``Conv2d(bias=False) -> BatchNorm -> SiLU``
unless said otherwise.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "autopad", "Conv", "RepConvN", "RepNBottleneck", "RepNCSP", "RepNCSPELAN4", "ELAN1", "AConv", "ADown",
    "SPPELAN", "CBLinear", "CBFuse", "Concat", "Silence", "DFL", "fuse_conv_bn",
]


def autopad(k: int, p: int | None = None, d: int = 1) -> int:
    """'Same' padding for an odd kernel ``k`` with dilation ``d`` (unless ``p`` is given)."""
    if p is not None:
        return p
    k_eff = d * (k - 1) + 1
    return k_eff // 2


def fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """Fold an eval-mode BatchNorm into the preceding convolution; returns a new conv with bias."""
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                      conv.dilation, conv.groups, bias=True).to(conv.weight.device)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    with torch.no_grad():
        fused.weight.copy_(conv.weight * scale.reshape(-1, 1, 1, 1))
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused.bias.copy_((bias - bn.running_mean) * scale + bn.bias)
    fused.requires_grad_(False)
    return fused


class Conv(nn.Module):
    """Conv2d + BatchNorm2d + SiLU (``act=False`` for no activation)."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, g: int = 1, d: int = 1,
                 act: bool | nn.Module = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), dilation=d, groups=g, bias=False)
        # BN hyper-parameters of the YOLO family: eps 1e-3, momentum 0.03.
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU() if act is True else (act if isinstance(act, nn.Module) else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    def fuse(self) -> None:
        """Fold the BN into the conv (inference only); forward then skips the BN."""
        if isinstance(self.bn, nn.BatchNorm2d):
            self.conv = fuse_conv_bn(self.conv, self.bn)
            self.bn = nn.Identity()


class RepConvN(nn.Module):
    """Re-parameterisable 3x3 conv: ``act(BN(conv3x3(x)) + BN(conv1x1(x)))`` (no identity branch).

    :meth:`fuse` merges both branches into a single 3x3 conv with bias.
    """

    def __init__(self, c1: int, c2: int, k: int = 3, s: int = 1, p: int = 1, g: int = 1, d: int = 1,
                 act: bool | nn.Module = True) -> None:
        super().__init__()
        if k != 3 or p != 1:
            raise ValueError("RepConvN supports k=3, p=1 only")
        self.conv1 = Conv(c1, c2, k, s, p=p, g=g, act=False)
        self.conv2 = Conv(c1, c2, 1, s, p=p - k // 2, g=g, act=False)
        self.act = nn.SiLU() if act is True else (act if isinstance(act, nn.Module) else nn.Identity())
        self.fused: nn.Conv2d | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.act(self.fused(x))
        return self.act(self.conv1(x) + self.conv2(x))

    def fuse(self) -> None:
        """Merge the 1x1 branch into the 3x3 kernel (zero-padded to 3x3) and both BNs into the bias."""
        if self.fused is not None:
            return
        k3 = fuse_conv_bn(self.conv1.conv, self.conv1.bn)
        k1 = fuse_conv_bn(self.conv2.conv, self.conv2.bn)
        with torch.no_grad():
            k3.weight += F.pad(k1.weight, [1, 1, 1, 1])
            k3.bias += k1.bias
        self.fused = k3
        del self.conv1, self.conv2


class RepNBottleneck(nn.Module):
    """RepConvN 3x3 then Conv 3x3, with a residual when the shapes allow it."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = RepConvN(c1, c_, 3, 1)
        self.cv2 = Conv(c_, c2, 3, 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class RepNCSP(nn.Module):
    """CSP block: half the channels go through ``n`` RepNBottlenecks, the other half bypass."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1, 1)
        self.m = nn.Sequential(*(RepNBottleneck(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class _ELAN(nn.Module):
    """The ELAN data flow: 1x1 ``cv1`` split in two halves ``a, b``; ``c = cv2(b)``, ``d = cv3(c)``;
    1x1 ``cv4`` over ``cat(a, b, c, d)``. Subclasses choose the two stages ``cv2`` and ``cv3``."""

    cv1: nn.Module
    cv2: nn.Module
    cv3: nn.Module
    cv4: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).chunk(2, 1)
        c = self.cv2(b)
        d = self.cv3(c)
        return self.cv4(torch.cat((a, b, c, d), 1))


class RepNCSPELAN4(_ELAN):
    """GELAN block: 1x1 conv split in two; the second half feeds two (RepNCSP + 3x3) stages; all four concatenated.

    Args: ``c1`` in, ``c2`` out, ``c3`` width of the first 1x1 conv, ``c4`` width of each stage, ``n``
    RepNBottlenecks per RepNCSP.
    """

    def __init__(self, c1: int, c2: int, c3: int, c4: int, n: int = 1) -> None:
        super().__init__()
        self.c = c3 // 2
        self.cv1 = Conv(c1, c3, 1, 1)
        self.cv2 = nn.Sequential(RepNCSP(c3 // 2, c4, n), Conv(c4, c4, 3, 1))
        self.cv3 = nn.Sequential(RepNCSP(c4, c4, n), Conv(c4, c4, 3, 1))
        self.cv4 = Conv(c3 + 2 * c4, c2, 1, 1)


class ELAN1(_ELAN):
    """Light ELAN block (YOLOv9-T/S stem): like RepNCSPELAN4 with plain 3x3 convs as stages."""

    def __init__(self, c1: int, c2: int, c3: int, c4: int) -> None:
        super().__init__()
        self.c = c3 // 2
        self.cv1 = Conv(c1, c3, 1, 1)
        self.cv2 = Conv(c3 // 2, c4, 3, 1)
        self.cv3 = Conv(c4, c4, 3, 1)
        self.cv4 = Conv(c3 + 2 * c4, c2, 1, 1)


def _smooth(x: torch.Tensor) -> torch.Tensor:
    # 2x2 average, stride 1, no padding: the anti-aliasing step in front of both down-samplers.
    return F.avg_pool2d(x, 2, 1, 0, False, True)


class AConv(nn.Module):
    """Down-sample by 2: 2x2 average (stride 1) then a 3x3 stride-2 Conv."""

    def __init__(self, c1: int, c2: int) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c2, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv1(_smooth(x))


class ADown(nn.Module):
    """Down-sample by 2: 2x2 average, then half the channels through a 3x3/2 Conv, half through max-pool 3/2 + 1x1 Conv."""

    def __init__(self, c1: int, c2: int) -> None:
        super().__init__()
        self.c = c2 // 2
        self.cv1 = Conv(c1 // 2, self.c, 3, 2, 1)
        self.cv2 = Conv(c1 // 2, self.c, 1, 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _smooth(x).chunk(2, 1)
        return torch.cat((self.cv1(a), self.cv2(F.max_pool2d(b, 3, 2, 1))), 1)


class SPPELAN(nn.Module):
    """Spatial pyramid pooling in ELAN form: 1x1 conv, three chained max-pools (k=5), concat, 1x1 conv."""

    def __init__(self, c1: int, c2: int, c3: int, k: int = 5) -> None:
        super().__init__()
        self.c = c3
        self.cv1 = Conv(c1, c3, 1, 1)
        self.pool = nn.MaxPool2d(k, 1, k // 2)
        self.cv5 = Conv(4 * c3, c2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = [self.cv1(x)]
        for _ in range(3):
            ys.append(self.pool(ys[-1]))
        return self.cv5(torch.cat(ys, 1))


class CBLinear(nn.Module):
    """PGI routing: one conv (with bias, no BN/act) whose output is split into ``c2s`` chunks."""

    def __init__(self, c1: int, c2s: Sequence[int], k: int = 1, s: int = 1, p: int | None = None, g: int = 1) -> None:
        super().__init__()
        self.c2s = [int(c) for c in c2s]
        self.conv = nn.Conv2d(c1, sum(self.c2s), k, s, autopad(k, p), groups=g, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.conv(x).split(self.c2s, dim=1)


class CBFuse(nn.Module):
    """PGI fusion: picks chunk ``idx[i]`` of each CBLinear input, resizes it (nearest) to the last input, sums all."""

    def __init__(self, idx: Sequence[int]) -> None:
        super().__init__()
        self.idx = [int(i) for i in idx]

    def forward(self, xs: list) -> torch.Tensor:
        target = xs[-1]
        out = target
        for i, x in zip(self.idx, xs[:-1]):
            out = out + F.interpolate(x[i], size=target.shape[2:], mode="nearest")
        return out


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``."""

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)


class Silence(nn.Module):
    """Identity layer: gives the input image a layer index so that a second backbone can start from it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DFL(nn.Module):
    """Distribution focal-loss integral: expected value of a softmax over ``c1`` bins, per box side."""

    def __init__(self, c1: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(c1, dtype=torch.float32).view(1, c1, 1, 1))
        self.c1 = c1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, a = x.shape  # x: [B, 4*c1, A]
        return self.conv(x.view(b, 4, self.c1, a).transpose(2, 1).softmax(1)).view(b, 4, a)
