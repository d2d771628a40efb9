"""The shared helpers of the test suite, in one place: import them from here
(``from tests.helpers import run_cli, tiny_config``).

- :mod:`.attention_maps`: one attention module's forward with its map (as need_weights builds it).
- :mod:`.cli`: the CLI run in-process, the one-error-line check, folder snapshots, a time limit.
- :mod:`.configs`: the tiny lmlab run configs (TINY, its ``--set`` forms, encoder, seq2seq).
- :mod:`.hf_models`: tiny random Hugging Face configs per reference family, weight perturbations,
  an HF folder writer.
- :mod:`.gguf_files`: tiny Llama GGUF files written the way llama.cpp's converter writes them.

Fixtures stay in tests/conftest.py.
"""

from tests.helpers.attention_maps import forward_with_map
from tests.helpers.cli import (
    assert_one_error,
    assert_unchanged,
    run_cli,
    signal_during,
    snapshot,
    within,
)
from tests.helpers.configs import (
    ENCODER,
    MODEL_KEYS,
    SEQ2SEQ,
    TINY,
    TINY_SET,
    TRAIN_SET,
    encoder_config,
    encoder_run_config,
    seq2seq_run_config,
    tiny_config,
    tiny_model_config,
    tiny_set,
    write_reverse_tsv,
)
from tests.helpers.gguf_files import (
    CHATML,
    llama_cpp_permute,
    tiny_llama_hf,
    write_llama_gguf,
    write_tiny_gguf,
)
from tests.helpers.hf_models import (
    hf_config,
    perturb_all,
    perturb_vectors,
    redraw,
    write_hf_folder,
)

__all__ = [
    "CHATML",
    "ENCODER",
    "MODEL_KEYS",
    "SEQ2SEQ",
    "TINY",
    "TINY_SET",
    "TRAIN_SET",
    "assert_one_error",
    "assert_unchanged",
    "encoder_config",
    "encoder_run_config",
    "forward_with_map",
    "hf_config",
    "llama_cpp_permute",
    "perturb_all",
    "perturb_vectors",
    "redraw",
    "run_cli",
    "seq2seq_run_config",
    "signal_during",
    "snapshot",
    "tiny_config",
    "tiny_llama_hf",
    "tiny_model_config",
    "tiny_set",
    "within",
    "write_hf_folder",
    "write_llama_gguf",
    "write_reverse_tsv",
    "write_tiny_gguf",
]
