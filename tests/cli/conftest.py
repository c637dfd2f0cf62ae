import pytest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama (the test configurations' Llama-3.2-1B shrunk), its tokenizer and 16 conversations: the model
    the kill tests convert and fine-tune."""
    from hf_fixtures import write_chat, write_model

    root = tmp_path_factory.mktemp("base")
    write_model("Llama-3.2-1B", root / "base")
    write_chat(root / "chat.jsonl", 16)
    return root
