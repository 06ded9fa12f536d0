"""Writing a tiny checkpoint as llama.cpp would: the shared head of every test GGUF writer
(the model's shape keys and its byte-level BPE tokenizer); callers add their own keys and
tensors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file


def interleave_rope_rows(rows, n_head: int):
    """llama.cpp's q/k row order for rope-interleaving archs (llama, mistral, granite):
    within each head, row 2i is HF's row i and row 2i + 1 is HF's row i + head_dim/2. Rows
    a numpy array or a tensor."""
    head_dim = rows.shape[0] // n_head
    order = [h * head_dim + i // 2 + (i % 2) * (head_dim // 2)
             for h in range(n_head) for i in range(head_dim)]
    return rows[order]


def start_gguf(model_dir: Path, path: Path, arch: str, *, name: str = "tiny",
               feed_forward: int | None = None, rope_dims: int | None = None
               ) -> tuple[gguf.GGUFWriter, dict, dict[str, torch.Tensor]]:
    """A writer for ``path`` holding ``model_dir``'s shape and tokenizer metadata under
    ``arch``, with the checkpoint's config and tensors. ``feed_forward`` and ``rope_dims``
    default to the config's intermediate_size and head_dim."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(cfg["vocab_size"]))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(feed_forward or cfg["intermediate_size"])
    writer.add_rope_dimension_count(rope_dims or cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    return writer, cfg, state
