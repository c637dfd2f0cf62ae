"""``allhere serve``: a converted model behind vLLM's OpenAI-compatible server."""

from __future__ import annotations

import argparse

from ..serve.serving import SERVE_BACKENDS
from . import args as a


def serve_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Needs vLLM and allhere's plugin in this Python (docs/serving.md: scripts/install_serve.sh). "
                "The server runs until Ctrl-C or SIGTERM; for an AHA model it prints mu_f (the share of "
                "(token, head) pairs on full attention) as requests come.")
    p.add_argument("--model", type=a.model_folder, required=True,
                   help="a transformers model folder (plain, or written by allhere convert / sft), a GGUF file (served "
                        "from a float32 safetensors copy written once into allhere's cache), or a fetched model's name "
                        "(allhere fetch: smollm2) (required)")
    p.add_argument("--host", type=a.host, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=a.port, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-model-len", type=a.positive, default=None,
                   help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--kv-cache-gib", type=a.positive_number, default=None,
                   help="memory for the KV cache in GiB (default: 4 on the CPU; on a GPU vLLM's share of its memory)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights and activations (default auto: the dtype config.json says the folder was saved in, "
                        "float32 where it says none; printed when the server is ready)")
    p.add_argument("--backend", choices=SERVE_BACKENDS, default="auto",
                   help="how the layers allhere computes run (default auto: on the CPU vLLM's own kernel where it "
                        "reads allhere's cache layout, allhere's torch path for the rest; on CUDA allhere's Triton "
                        "paged kernel for AHA). torch: never the Triton kernel; triton: AHA in the Triton kernel only; "
                        "reference: every such layer by the dense float32 reference (slow: for checking)")


def serve(args) -> None:
    from ..serve.launch import serve as run

    run(args.model, host=args.host, port=args.port, max_model_len=args.max_model_len, dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, verbose=args.verbose, backend=args.backend)
