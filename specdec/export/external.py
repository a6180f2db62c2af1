"""A bundle graph's weight file, written one initializer at a time.

`ExternalData.put(tensor)` appends the tensor's bytes to the file and returns it as an external-data reference
(location, offset, length): the graph proto then holds no weights, and a model of any size is written with one
tensor in memory at a time. Large tensors start on a page boundary, where onnxruntime's memory map reads them in
place.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SMALL = 1024  # bytes; smaller initializers stay inside the graph (as onnx.save_model's size_threshold)
PAGE = 4096


class ExternalData:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "wb")
        self.written = 0

    def put(self, tensor: TensorProto) -> TensorProto:
        data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        if len(data) < SMALL:
            return tensor
        return self._reference(tensor.name, tensor.data_type, tensor.dims, self._append(data))

    def put_array(self, name: str, arr: np.ndarray) -> TensorProto:
        """A numpy array's bytes appended as they lie in memory (no serialized copy of them is made)."""
        arr = np.ascontiguousarray(arr)
        if arr.nbytes < SMALL:
            return numpy_helper.from_array(arr, name)
        dtype = helper.np_dtype_to_tensor_dtype(arr.dtype)
        return self._reference(name, dtype, arr.shape, self._append(memoryview(arr.reshape(-1)).cast("B")))

    def _append(self, data) -> tuple[int, int]:
        """Write `data` at the next aligned offset; (offset, length)."""
        align = PAGE if len(data) >= (1 << 20) else 64
        pad = -self.written % align
        if pad:
            self._f.write(b"\0" * pad)
        offset = self.written + pad
        self._f.write(data)
        self.written = offset + len(data)
        return offset, len(data)

    def _reference(self, name: str, data_type: int, dims, where: tuple[int, int]) -> TensorProto:
        offset, length = where
        ref = TensorProto()
        ref.name, ref.data_type = name, data_type
        ref.dims.extend(int(d) for d in dims)
        ref.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = ref.external_data.add()
            entry.key, entry.value = key, value
        return ref

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ExternalData":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_streamed(model: onnx.ModelProto, path: Path) -> None:
    """Save a graph whose initializers already point into its weight file (no weights are loaded or copied)."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
