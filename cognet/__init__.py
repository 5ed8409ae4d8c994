"""cognet: COGNet medication recommendation, trained in PyTorch and served from ONNX.

This package file stays import-light: the torch-free runtime (`cognet.runtime`) imports
`cognet` first, so nothing here may pull in torch.
"""

__version__ = "0.3.0"
