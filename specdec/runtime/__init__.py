"""The torch-free runtime: numpy + onnxruntime + tokenizers."""
