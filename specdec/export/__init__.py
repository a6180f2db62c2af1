"""Export side: turns a target (and its drafter) into a bundle. May use torch, transformers, onnx."""
import os

# transformers' GGUF reader and other libraries draw their own tqdm bars; specdec's commands show one progress
# display. tqdm reads this when it is first imported, so it is set as soon as the export package is.
os.environ.setdefault("TQDM_DISABLE", "1")
