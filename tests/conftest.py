import os

# Without a GPU, Triton kernels run through Triton's CPU interpreter; this must be set before any
# @triton.jit function is defined, i.e. before the kernels are imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
