"""A bundle graph's weight file, written one initializer at a time.

`ExternalData.put(tensor)` appends the tensor's bytes to the file and returns it as an external-data reference
(location, offset, length): the graph proto then holds no weights, and a model of any size is written with one
tensor in memory at a time. Large tensors start on a page boundary, where onnxruntime's memory map reads them in
place.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

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
        align = PAGE if len(data) >= (1 << 20) else 64
        pad = -self.written % align
        if pad:
            self._f.write(b"\0" * pad)
        offset = self.written + pad
        self._f.write(data)
        self.written = offset + len(data)
        ref = TensorProto()
        ref.name, ref.data_type = tensor.name, tensor.data_type
        ref.dims.extend(tensor.dims)
        ref.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(len(data)))):
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
