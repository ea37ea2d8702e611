"""Real checkpoint sets for the whole-checkpoint verification tests of both tiers: DCP
directories (torch.distributed.checkpoint.save) and Hugging Face sharded checkpoints
(save_pretrained), made here, never downloaded. torch is imported when a set is made."""
from __future__ import annotations

import os
import warnings

import pytest


def dcp_save(directory, rows: int = 4, seed: int = 0) -> str:
    """A real DCP save (single process, two writer threads: two .distcp shards)."""
    import torch
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(seed)
    state = {"w": torch.randn(rows, 8), "b": torch.zeros(rows), "step": seed,
             "nested": {"x": torch.arange(10 * rows)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=2))
    return str(directory)


def hf_save(directory, vocab: int = 100, shard: str = "20KB", seed: int = 0) -> str:
    """A real sharded save_pretrained of a tiny GPT-2 built from a config (no download)."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(directory), max_shard_size=shard)
    return str(directory)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Whole sets, saved once per test module: two DCP saves of different tensor sizes, an HF
    sharded save, another model's and another sharding of the same model (tests marked torch;
    the HF ones need transformers)."""
    root = tmp_path_factory.mktemp("saves")
    return {
        "dcp": dcp_save(root / "dcp"),
        "dcp_big": dcp_save(root / "dcp_big", rows=6, seed=1),     # other tensor sizes
        "hf": hf_save(root / "hf"),
        "hf_other": hf_save(root / "hf_other", vocab=120, seed=1),  # other vocabulary
        "hf_resharded": hf_save(root / "hf_resharded", shard="40KB"),
    }


def shards(directory, suffix):
    return sorted(n for n in os.listdir(directory) if n.endswith(suffix))
