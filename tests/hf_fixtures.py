"""Tiny Hugging Face model folders as users have them on disk: a tokenizer, the published config.json
(``real_configs``: tied embeddings, rope scaling, ... shrunk to tiny sizes, in the format it was published
in), weights in the published dtype, optionally sharded into ``model-0000x-of-0000y.safetensors`` with an
index. Random weights, built offline."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from real_configs import STORED_DTYPE, tiny

WORDS = [f"w{i}" for i in range(90)]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


@lru_cache(maxsize=1)
def _byte_bpe() -> str:
    """A byte-level BPE (the kind Llama-3, Qwen2.5/3, SmolLM2, OLMo-2 and Pythia ship), trained here on a
    few lines of WORDS and Python, as JSON."""
    lines = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(40)) for i in range(60)]
    lines += ["def __init__(self):\n    x = []\nimport os\n"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok.to_str()


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_byte_bpe()), eos_token="</s>",
                                                bos_token="<s>", pad_token="<pad>", unk_token="<unk>")


def write_model(name: str, folder: Path, shards: bool = False, seed: int = 0, init_std: float | None = None,
                **overrides) -> Path:
    """``folder`` with the tiny version of the published model ``name`` (``overrides``: config.json entries
    to change) and the tokenizer. Returns ``folder``. ``init_std``: every matrix drawn from N(0, init_std^2)
    instead of transformers' initialisation (0.1: a model whose greedy tokens vary and depend on which keys
    each query reads; transformers' 0.02 mostly repeats one token whatever the attention does)."""
    folder = Path(folder)
    tok = make_tokenizer()
    published = tiny(name, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    published.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published, indent=2))
    config = transformers.AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)
    # the published dtype: torch_dtype, or dtype (files written by transformers >= 4.56), or STORED_DTYPE
    dtype = published.get("torch_dtype") or published.get("dtype") or STORED_DTYPE.get(name, "float32")
    model.to(getattr(torch, dtype))
    model.save_pretrained(str(folder), max_shard_size="20KB" if shards else "5GB")
    (folder / "config.json").write_text(json.dumps(published, indent=2))  # as published, not re-serialised
    tok.save_pretrained(str(folder))
    return folder


def write_chat(path: Path, n: int = 16, seed: int = 0) -> Path:
    """A jsonl of ``n`` two-turn conversations whose replies repeat the question reversed (learnable)."""
    rng = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = [WORDS[i] for i in torch.randint(0, len(WORDS), (5,), generator=rng).tolist()]
            msgs = [{"role": "user", "content": " ".join(q)}, {"role": "assistant", "content": " ".join(q[::-1])}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def write_texts(folder: Path, n: int = 6, words: int = 80, seed: int = 0) -> Path:
    """A folder of ``n`` text documents of ``words`` words of the tokenizer's vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(seed)
    for i in range(n):
        ids = torch.randint(0, len(WORDS), (words,), generator=rng).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(WORDS[j] for j in ids) + "\n")
    return folder
