"""``allhere serve``: a converted model behind vLLM's OpenAI-compatible server."""

from __future__ import annotations

import argparse

from ..serve.serving import SERVE_BACKENDS
from . import args as a


@a._named("API key")
def api_key(value: str) -> str:
    """A key clients send as ``Authorization: Bearer KEY``: printable ASCII, no spaces (a header carries nothing
    else). Never echoed back."""
    if not value:
        raise a.Bad("expected a key, got an empty one")
    if not all(33 <= ord(c) <= 126 for c in value):
        raise a.Bad("expected printable ASCII without spaces or control characters (the key itself is not shown)")
    return value


def serve_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Needs vLLM and allhere's plugin in this Python (docs/serving.md: scripts/install_serve.sh). "
                "The server runs until Ctrl-C or SIGTERM (exit code 130 / 143, vLLM's processes stopped); for an "
                "AHA model it prints mu_f (the share of (token, head) pairs on full attention) as requests come, "
                "and vLLM's /metrics carries it as allhere_mu_f.")
    p.add_argument("--model", type=a.model_folder, required=True,
                   help="a transformers model folder (plain, or written by allhere convert / sft), a GGUF file (served "
                        "from a float32 safetensors copy written once into allhere's cache), or a fetched model's name "
                        "(allhere fetch: smollm2) (required)")
    p.add_argument("--host", type=a.host, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; any other address without an API "
                        "key gets a warning: anyone who can reach the port can use the model)")
    p.add_argument("--port", type=a.port, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", type=api_key, default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' to /v1/... (401 otherwise; /health and "
                        "/metrics stay open; default: $VLLM_API_KEY, else no key). vLLM gets the key in its "
                        "environment, never on its command line; VLLM_API_KEY keeps it off this one too (ps)")
    p.add_argument("--ssl-certfile", type=a.existing_file, default=None, metavar="PEM",
                   help="serve https with this certificate (a PEM file; with --ssl-keyfile; default: plain http, for "
                        "a loopback address or behind a TLS proxy)")
    p.add_argument("--ssl-keyfile", type=a.existing_file, default=None, metavar="PEM",
                   help="the certificate's private key (a PEM file; with --ssl-certfile; default: none, plain http)")
    p.add_argument("--max-model-len", type=a.positive, default=None, metavar="N",
                   help="longest prompt + completion in tokens; a longer request gets 400 (default: the model's own "
                        "maximum, lowered to what the KV cache holds for one request, vLLM's auto-fit)")
    p.add_argument("--max-num-seqs", type=a.positive, default=None, metavar="N",
                   help="requests computed at once; more wait in the queue (default: vLLM's, 128 on the CPU, 256 to "
                        "1024 on a GPU by its memory)")
    p.add_argument("--max-num-batched-tokens", type=a.positive, default=None, metavar="N",
                   help="tokens computed in one step, long prompts prefilled in chunks of at most this (default: "
                        "vLLM's, 2048 on the CPU); at least --max-num-seqs")
    p.add_argument("--max-queued", type=a.positive, default=None, metavar="N",
                   help="requests in flight (computed or waiting); beyond it a new request gets 503 at once instead of "
                        "waiting in an unbounded queue (default 1024, or --max-num-seqs where that is more)")
    p.add_argument("--kv-cache-gib", type=a.positive_number, default=None,
                   help="memory for the KV cache in GiB (default: 4 on the CPU; on a GPU vLLM's share of its memory)")
    p.add_argument("--ready-timeout", type=a.positive_number, default=900.0, metavar="SECONDS",
                   help="seconds to wait for vLLM's /health to answer 200 before giving up and stopping it (default "
                        "900)")
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
        kv_cache_gib=args.kv_cache_gib, verbose=args.verbose, backend=args.backend, api_key=args.api_key,
        max_num_seqs=args.max_num_seqs, max_queued=args.max_queued, ready_timeout=args.ready_timeout,
        max_num_batched_tokens=args.max_num_batched_tokens, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile)
