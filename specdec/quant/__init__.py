"""Weight quantization of specdec graphs (export side: may use onnx and onnxruntime's quantizer)."""
