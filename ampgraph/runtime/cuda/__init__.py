"""The CUDA runtime: low-precision weights kept between steps and refreshed once per step by
multi-tensor ops (``master_weights.py``); every other op is aten's (cuBLAS, cuDNN and the
fused attention kernels). Portable torch ops only, so the tests run it on CPU tensors by
selecting it by name.
"""
