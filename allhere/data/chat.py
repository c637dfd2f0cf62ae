"""Chat data for supervised fine-tuning (the Tulu-3 layout): rows with ``messages`` = a list of
``{"role", "content"}``, read from JSONL or parquet with ``datasets``; rendered with the tokenizer's chat
template; loss only on assistant tokens; packed into fixed-length sequences.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..masks import starts_from
from .corpus import DataError

# Used when the tokenizer has no chat template of its own: one header line per turn, EOS after each turn.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_chat(path: str | Path):
    """A ``datasets.Dataset`` of conversations from a .jsonl/.json or .parquet file (or a folder of them)."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise DataError(f"chat data {p} does not exist")
    files = sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".json", ".parquet")) if p.is_dir() else [p]
    if not files:
        raise DataError(f"chat data folder {p} holds no .jsonl, .json or .parquet file")
    kind = "parquet" if files[0].suffix == ".parquet" else "json"
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        raise DataError(f"chat data file {empty[0]} is empty")
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise DataError(f"chat data {p} could not be read as {kind}: {e}") from e
    if "messages" not in ds.column_names:
        raise DataError(f"chat data {p} has no 'messages' column (columns: {ds.column_names}); expected rows "
                        "like {\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}")
    if len(ds) == 0:
        raise DataError(f"chat data {p} is empty")
    for i, messages in enumerate(ds["messages"]):
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataError(f"chat data {p}, row {i}: 'messages' must be a non-empty list of {{'role': str, "
                            f"'content': str}}, got {str(messages)[:80]}")
    if not any(m["role"] == "assistant" for messages in ds["messages"] for m in messages):
        raise DataError(f"chat data {p} has no assistant turn: there is nothing to learn from (the loss is "
                        "taken on assistant replies)")
    return ds


def ensure_chat_template(tokenizer) -> bool:
    """Install the fallback template when the tokenizer has none. Returns True if it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return True


def _ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and, per token, whether it belongs to an assistant reply.

    An assistant turn's tokens are those its rendering adds after the prefix with the generation prompt,
    so the header that announces the reply is not trained on, the reply and its end token are.
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"a message must be {{'role': ..., 'content': ...}}, got {m!r}")
    ids = _ids(tokenizer, messages)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_ids(tokenizer, messages[:i], add_generation_prompt=True))
        end = len(_ids(tokenizer, messages[: i + 1]))
        for t in range(start, min(end, len(ids))):
            mask[t] = True
    return ids, mask


def pack(conversations: list[tuple[list[int], list[bool]]], seq_len: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate conversations and cut the stream into [n, seq_len] ids, assistant masks and segment
    starts (the tail that does not fill a sequence is dropped). Each token's segment start is the
    position in its row where its conversation starts (0 for a conversation carried over from the
    previous row), so each conversation attends only to itself (``allhere.masks.starts_from``)."""
    ids = [t for c in conversations for t in c[0]]
    mask = [m for c in conversations for m in c[1]]
    positions = [p for c in conversations for p in range(len(c[0]))]
    n = len(ids) // seq_len
    if n == 0:
        raise DataError(f"the chat data holds {len(ids)} tokens, fewer than one sequence of {seq_len}")
    ids, mask, positions = (torch.tensor(x[: n * seq_len]).view(n, seq_len) for x in (ids, mask, positions))
    return ids, mask, starts_from(position_ids=positions)
