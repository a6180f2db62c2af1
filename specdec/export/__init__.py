"""Export side: turns a target (and its drafter) into a bundle. May use torch, transformers, onnx."""
