"""Pure pixel kernels: numpy/cv2 (``tiles``, ``color``, ``flip``) and their torch twins (``torch_ops``)."""
