"""ggml's tensors as llama.cpp's graph callback hands them over: the struct's layout, a node's name, its values.

Only the fields read here are relied on; the layout is ggml.h's of the version llama-cpp-python 0.3.x vendors.
"""

from __future__ import annotations

import ctypes

import numpy as np

GGML_F32, GGML_F16 = 0, 1


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor of ggml.h (the version vendored by llama-cpp-python 0.3.x): only read, never written."""

    _fields_ = [
        ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GGMLTensor.name.offset


def tensor_array(ggml, t: int) -> np.ndarray:
    """A ggml tensor's values as numpy (ne3, ne2, ne1, ne0): a view of host memory, or a copy from a device."""
    tt = GGMLTensor.from_address(t)
    if tt.type not in (GGML_F32, GGML_F16):
        raise ValueError(f"tensor {tt.name!r} has ggml type {tt.type}, not F32 or F16")
    dtype = np.float32 if tt.type == GGML_F32 else np.float16
    shape = tuple(int(n) for n in reversed(tt.ne))
    strides = tuple(int(s) for s in reversed(tt.nb))
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + np.dtype(dtype).itemsize
    if tt.buffer and ggml.ggml_backend_buffer_is_host(tt.buffer):
        raw = (ctypes.c_char * extent).from_address(tt.data)
    else:  # a GPU build: the bytes come over first
        n = int(ggml.ggml_nbytes(t))
        raw = np.empty(max(n, extent), dtype=np.uint8)
        ggml.ggml_backend_tensor_get(t, raw.ctypes.data, 0, n)
    return np.ndarray(shape, dtype=dtype, buffer=raw, strides=strides)
