"""Clean-room YOLOv9 / GELAN trainer on fastload batches.

- :mod:`yolov9.models`: YAML configs (official schema), blocks, DDetect/DualDDetect, re-parameterisation.
- :mod:`yolov9.loss`, :mod:`yolov9.assigner`: task-aligned assignment, BCE + CIoU + DFL, dual-branch loss.
- :mod:`yolov9.metrics`, :mod:`yolov9.nms`: mAP as the official val.py or pycocotools scores it, torchvision NMS.
- CLIs: ``python -m yolov9.train``, ``python -m yolov9.val``, ``python -m yolov9.detect``.
"""
__all__ = ["models"]
