import os

import pytest

# Without a GPU, Triton kernels run through Triton's CPU interpreter; this must be set before any
# @triton.jit function is defined, i.e. before the kernels are imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"



@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers reading the embedded SmolLM2 GGUF independently (fp32): the reference model
    of the parity and scoring tests, loaded once."""
    import torch
    import transformers

    from service.model.files import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
