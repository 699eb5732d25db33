"""``tandem``'s command line as parsers: every command, its options (each a flag, a ``TANDEM_*`` variable and a
``--config`` key, through ``settings``), their help, and where ``tandem serve`` listens (``_serve_addresses``).
Nothing here runs a command: ``cli`` dispatches the parsed namespace."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import models
from .demo import DEFAULT_PROMPT
from .settings import CommandParser
from .terminal_chat import FIXED_TREE, unescape


def _add_chat_args(p: CommandParser) -> None:
    p.option("--drafter", "default", help="'default' (pinned Qwen2.5-Coder-0.5B) or a GGUF path")
    p.option("--drafter-engine", "auto", help="auto | llama.cpp | onnx (exported once, cached); auto: onnx where it "
                                              "exports without torch (the default drafter), else llama.cpp")
    p.option("--vocab", "", help="VocabTrim head vocabulary (.npy from `tandem drafter vocabtrim`; onnx engine)")
    p.option("--learn-vocab", True, bool, help="re-rank the --vocab head from the tokens the verifier commits")
    p.option("--ngram", False, bool, help="graft prompt-lookup (n-gram) drafts onto every tree")
    p.option("--drafter-threads", 0, int, help="0 = all cores")
    p.option("--tree", None, help=f"draft this fixed tree shape k,N,D every round (k=1 is a chain) instead of the "
                                  f"adaptive policy; with --no-adaptive and no shape: {FIXED_TREE}")
    p.option("--adaptive", None, bool,
             help="the draft policy chooses, from measured link, costs and acceptance, between cloud-only decoding and "
                  "drafting, and the tree (the default unless --tree is given)")
    p.option("--objective", "latency", choices=("latency", "cloud_cost"),
             help="with --adaptive: fastest answers, or fewest verifier forwards without being slower than cloud-only "
                  "decoding")
    p.option("--proactive", False, bool,
             help="draft the next tree while the verdict is in flight (hides the round trip when it holds)")
    p.option("--shadow", True, bool,
             help="with --adaptive: while cloud-only decoding runs, the idle drafter drafts chains on the streamed "
                  "text (never sent) to measure this request's acceptance; --no-shadow keeps it idle (battery)")
    p.option("--max-tokens", 256, int, help="the longest answer, in tokens (a longer one is cut, and says so)")
    p.option("--temperature", 0.0, float)
    p.option("--top-k", 0, int)
    p.option("--top-p", 1.0, float)
    p.option("--min-p", 0.0, float)
    p.option("--seed", None, int, help="pin the random draws: the same seed and prompt give the same answer "
                                       "(default: fresh)")
    p.add_argument("--stop", action="append", type=unescape,
                   help="stop string (repeatable); backslash escapes as in Python: --stop '\\n\\n' stops at a blank "
                        "line")
    p.option("--system", "", help="system message")
    p.option("--n-ctx", 4096, int)


# Every setting a deployment can pass through the environment (docker-compose, k8s): TANDEM_<FLAG> -> --flag
# (``settings``). Besides these: TANDEM_API_KEYS / TANDEM_API_KEYS_FILE (REST), TANDEM_VERIFIER_KEYS /
# TANDEM_VERIFIER_KEYS_FILE (gRPC), TANDEM_GATEWAY_KEYS[_FILE] (gateways' verifier keys), TANDEM_METRICS_KEYS[_FILE]
# (/metrics scrapers), TANDEM_TEACH_KEYS[_FILE] / TANDEM_REST_TEACH_KEYS[_FILE] (verifier / REST keys whose tenants
# opted in to distillation) and TANDEM_VERIFIER_KEY / TANDEM_API_KEY (a client's key for the verifier) (core.auth),
# TANDEM_SALT_SECRET[_FILE] (core.tenancy), TANDEM_CACHE (core.cache), TANDEM_LOG (core.logs).
ENV_KEYS = CommandParser.variables
OTHER_ENV_KEYS = ("TANDEM_API_KEYS", "TANDEM_API_KEYS_FILE", "TANDEM_API_KEY", "TANDEM_VERIFIER_KEYS",
                  "TANDEM_VERIFIER_KEYS_FILE", "TANDEM_VERIFIER_KEY", "TANDEM_VERIFIER_KEY_FILE", "TANDEM_CACHE",
                  "TANDEM_GATEWAY_KEYS", "TANDEM_GATEWAY_KEYS_FILE", "TANDEM_METRICS_KEYS",
                  "TANDEM_METRICS_KEYS_FILE", "TANDEM_SALT_SECRET", "TANDEM_SALT_SECRET_FILE",
                  "TANDEM_TEACH_KEYS", "TANDEM_TEACH_KEYS_FILE", "TANDEM_REST_TEACH_KEYS",
                  "TANDEM_REST_TEACH_KEYS_FILE",
                  "TANDEM_LOG", "TANDEM_CONFIG",
                  "TANDEM_LLAMA_EXTRA_BUFTS", "TANDEM_LLAMA_CPU_VARIANT")  # the last two: core.llama_probe


def env_keys() -> set[str]:
    """Every TANDEM_* variable Tandem reads."""
    parser()  # registers the flag-backed keys
    return set(ENV_KEYS) | set(OTHER_ENV_KEYS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> CommandParser:
    ap = CommandParser(prog="tandem", description="Lossless edge-cloud speculative decoding.")
    ap.add_argument("--version", action="version", version=f"tandem {_version()}")
    ap.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"),
                    help="TOML file of option values (top level or per subcommand table) [$TANDEM_CONFIG]")
    ap.add_argument("--log-level", default=None, help="debug|info|warning (default: warning, or $TANDEM_LOG)")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_models_parser, _serve_parser, _chat_parser, _drafter_parser, _health_parser, _demo_parser):
        add(sub)
    return ap


def _models_parser(sub) -> None:
    m = sub.add_parser("models", help="model provisioning")
    msub = m.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download, assemble and verify the default model pair, or a named model")
    f.add_argument("name", nargs="?", choices=tuple(models.NAMED_MODELS),
                   help="a named model (e.g. gemma3-270m, a drafter of another family); usable wherever a drafter "
                        "path is (--drafter gemma3-270m)")
    f.add_argument("--role", choices=("all", *models.ROLES), default="all")
    msub.add_parser("list", help="the pinned models and their state in the cache")
    c = msub.add_parser("check", help="whether a drafter can draft for a target (native, padded, translated or "
                                      "refused) and its acceptance on a few prompts; exits 1 for a refused pair")
    c.add_argument("--target", default="default", help="target GGUF file or Hugging Face model directory")
    c.add_argument("--drafter", default="default", help="drafter GGUF file or a named model (gemma3-270m)")
    c.add_argument("--prompts", type=int, default=2, metavar="N",
                   help="HumanEval and ShareGPT prompts each to measure acceptance on (0: the pairing only)")
    c.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    c.add_argument("--threads", type=int, default=0)
    c.add_argument("--json", metavar="PATH", help="also write the result as JSON")


SERVE_EPILOG = """\
keys (environment only, comma-separated; each also as a file, one key a line: $NAME_FILE):
  TANDEM_API_KEYS         REST API keys clients send as 'Authorization: Bearer KEY' (with --api-key); without
                          any, serve listens on loopback only (unless --allow-unauthenticated)
  TANDEM_VERIFIER_KEYS    keys that open the gRPC verifier (edge devices, remote gateways)
  TANDEM_GATEWAY_KEYS     verifier keys of gateways, exempt from the per-key limits
  TANDEM_METRICS_KEYS     keys of /metrics scrapers
  TANDEM_TEACH_KEYS, TANDEM_REST_TEACH_KEYS   verifier / REST keys whose tenants opted in to distillation
  TANDEM_VERIFIER_KEY     the key this gateway presents to a remote --verifier
  TANDEM_SALT_SECRET      the cache-partition secret (edge tokens outlive a restart with it)
addresses: --host/--port are the REST gateway's (as in vLLM), --grpc-host/--grpc-port the verifier's. Given
--http-host or --http-port (deprecated, or $TANDEM_HTTP_HOST/$TANDEM_HTTP_PORT), --host/--port keep their old
meaning, the verifier's, for this release."""

GRPC_PORT, HTTP_PORT, LOOPBACK = 50051, 8000, "127.0.0.1"
MAX_AUTO_DRAFTERS = 8


def auto_gateway_drafters(cores: int | None = None) -> int:
    """The gateway's drafters when not given: one per 4 cores (each drafts on a share of them), 1 to 8."""
    return max(1, min(MAX_AUTO_DRAFTERS, (cores or os.cpu_count() or 1) // 4))


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run a verifier (gRPC) and the OpenAI-compatible REST gateway",
                       epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _serve_verifier_options(s)
    _serve_gateway_options(s)
    _serve_security_options(s)
    s.finish = _serve_addresses


def _serve_addresses(a: argparse.Namespace) -> list[str]:
    """Settle where serve listens (``grpc_host``/``grpc_port``, ``http_host``/``http_port``, 0: no gateway) and the
    gateway's drafters; ``deprecated`` is the line to print for the old spelling, else empty. The errors, if any."""
    old = [f for f in ("http_host", "http_port") if getattr(a, f) is not None]
    a.deprecated, errors = "", []
    if old:  # the old spelling: --host/--port are the verifier's, --http-host/--http-port the gateway's
        for new, was in (("grpc_host", "host"), ("grpc_port", "port")):
            if getattr(a, new) is not None and getattr(a, was) is not None:
                errors.append(f"--{was} and --{new.replace('_', '-')} both name the verifier's address here (with "
                              f"the deprecated --{old[0].replace('_', '-')}, --{was} is the verifier's): give "
                              f"--host/--port (REST) and --grpc-host/--grpc-port (gRPC)")
        grpc_host, grpc_port = _first(a.grpc_host, a.host, LOOPBACK), _first(a.grpc_port, a.port, GRPC_PORT)
        http_host, http_port = _first(a.http_host, LOOPBACK), _first(a.http_port, HTTP_PORT)
        a.grpc_port_flag, a.http_port_flag = "--port" if a.grpc_port is None else "--grpc-port", "--http-port"
        spelled = ", ".join(a.sources.get(f, "--" + f.replace("_", "-")) for f in old)
        a.deprecated = (f"{spelled}: deprecated spelling, and with it --host/--port still name the verifier (gRPC). "
                        f"Use --host/--port for the REST gateway and --grpc-host/--grpc-port for the verifier, as "
                        f"in vLLM (the old spelling goes in the next release).")
    else:
        grpc_host, grpc_port = _first(a.grpc_host, LOOPBACK), _first(a.grpc_port, GRPC_PORT)
        http_host, http_port = _first(a.host, LOOPBACK), _first(a.port, HTTP_PORT)
        a.grpc_port_flag, a.http_port_flag = "--grpc-port", "--port"
    if not a.gateway:
        http_port = 0
    for name, port in (("grpc", grpc_port), ("http", http_port)):
        if not 0 <= port <= 65535:
            errors.append(f"the {'verifier' if name == 'grpc' else 'REST'} port {port} is not in 0..65535")
    a.grpc_host, a.grpc_port, a.http_host, a.http_port = grpc_host, grpc_port, http_host, http_port
    if a.verifier and not http_port:
        errors.append("--verifier serves the REST gateway alone, in front of that verifier: not with --no-gateway "
                      f"or {a.http_port_flag} 0 (nothing would be served)")
    if a.gateway_drafters < 0:
        errors.append(f"--gateway-drafters {a.gateway_drafters}: give 1 or more (0: {auto_gateway_drafters()} "
                      f"on this machine)")
    a.gateway_drafters = a.gateway_drafters or auto_gateway_drafters()
    if a.host_drafters < 0:
        errors.append(f"--host-drafters {a.host_drafters}: give 0 (none) or more")
    if a.host_drafters and a.verifier:
        errors.append("--host-drafters drafts beside this process's verifier: not with --verifier (a gateway alone)")
    if a.gateway_queue_depth < 0 or not a.gateway_queue_timeout_s > 0:
        errors.append("--gateway-queue-depth must be >= 0 and --gateway-queue-timeout-s > 0")
    return errors


def _first(*values):
    return next(v for v in values if v is not None)


def _serve_verifier_options(s) -> None:
    s.option("--target", "default", aliases=("--model",),
             help="the target model (--model, as in vLLM): 'default' (pinned Qwen2.5-Coder-1.5B), a GGUF file or a "
                  "Hugging Face directory (--engine torch)")
    s.option("--engine", "llama.cpp", choices=("llama.cpp", "torch", "scripted"),
             help="llama.cpp; torch (HF directory or GGUF, CUDA if present); scripted (a rule for a target, no "
                  "model: for client implementers, docs/protocol.md)")
    s.option("--grpc-host", None, help="the verifier's (gRPC) bind address (default: 127.0.0.1; keys are required "
                                       "off loopback)")
    s.option("--grpc-port", None, int, help=f"the verifier's (gRPC) port (default: {GRPC_PORT}; 0: any free port)")
    s.option("--threads", 0, int, help="verifier threads, 0 = all cores")
    s.option("--n-ctx", 4096, int)
    s.option("--max-sessions", 4, int, help="sessions per replica (KV is reserved for each)")
    s.option("--prefix-cache-tokens", 4096, int,
             help="KV kept for finished sessions' histories, reused by the next turn of a chat (0: off)")
    s.option("--deterministic", False, bool,
             help="bit-identical output whatever drafting, trees or batching do: logits independent of batch shape "
                  "(both engines; fixed-size forwards, one session each, no prefix cache)")
    s.option("--max-tree-nodes", 64, int)
    s.option("--max-tree-depth", 16, int)
    s.option("--chat-template", "", help="Jinja chat template file the verifier publishes to clients instead of the "
                                         "target's own (GGUF metadata / tokenizer_config.json)")
    s.option("--max-batch-tokens", 512, int, help="token budget of one verify forward")
    s.option("--batch-window-ms", 2.0, float, help="longest wait for more drafts to batch")
    s.option("--serial-prefill", False, bool, help="compute each prompt whole, in forwards of its own between "
                                                   "batches, instead of in chunks inside the verify forwards "
                                                   "(chunked prefill, the default on llama.cpp)")
    s.option("--verify-budget-tokens", 0, int,
             help="most tokens in one verify forward under load, reached by pruning the least probable draft nodes of "
                  "all sessions instead of holding drafts back (holds verify latency; 0: off)")
    s.option("--verify-budget-ms", 0.0, float,
             help="the same budget as a latency target: each verify forward holds the tokens the replica's measured "
                  "forward cost fits in this many ms (0: off; with --verify-budget-tokens, the smaller)")
    s.option("--verifier-cost", "", help="simulate a verifier: pace each forward to this cost curve (JSON, "
                                         "deploy/cost-curves/); real logits, labelled simulated")
    s.option("--cost-scale", 1.0, float, help="multiply the cost curve's times (to slow a whole run down evenly)")
    s.option("--replicas", 0, int, help="run a Ray pool of this many replicas (0 = in process)")
    s.option("--host-drafters", 0, int,
             help="drafters on this host (the --drafter model, each on a share of the cores) for sessions that ask "
                  "the verifier to draft: thin clients, slow or far devices (docs/drafting.md); 0: none")
    s.option("--ray-address", None, help="existing Ray cluster, e.g. ray-head:6379 (default: a local Ray)")
    s.option("--cpus-per-replica", 1.0, float, help="CPU slice per replica when there is no GPU")
    s.option("--replica-resource", "", help="place replicas only on Ray nodes that advertise this custom resource, "
                                            "one replica per unit (ray start --resources '{\"NAME\": 1}')")


def _serve_gateway_options(s) -> None:
    s.option("--verifier", "", help="gateway only: the verifier at this address instead of a local one",
             env="TANDEM_GATEWAY_VERIFIER")  # not TANDEM_VERIFIER: chat's, which must not turn serve into a gateway
    s.option("--host", None, help=f"the REST gateway's bind address (default: {LOOPBACK}; keys are required off "
                                  f"loopback)")
    s.option("--port", None, int, help=f"the REST gateway's port (default: {HTTP_PORT}; 0: no gateway)")
    s.option("--gateway", True, bool, help="serve the REST gateway (--no-gateway: the verifier alone)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="a REST API key clients must send (repeatable, or comma-separated; adds to "
                        "$TANDEM_API_KEYS, which keeps keys out of the process list)")
    s.option("--http-host", None, help="deprecated: --host (with it, --host is the verifier's address)")
    s.option("--http-port", None, int, help="deprecated: --port (with it, --port is the verifier's port)")
    s.option("--served-model-name", "", help="model ids of the REST API, comma-separated: the first is the id "
                                             "answers carry, the others aliases (default: a slug of the target's "
                                             "file name)")
    s.option("--model-name", "", help="the served model id (older name of --served-model-name with one id)")
    s.option("--gateway-drafters", 0, int,
             help=f"co-located drafters = REST generations at once (0: one per 4 cores, 1 to {MAX_AUTO_DRAFTERS}: "
                  f"{auto_gateway_drafters()} on this machine)")
    s.option("--gateway-queue-depth", 64, int,
             help="requests that wait for a drafter when all are busy, first come first served (beyond: 429; 0: "
                  "no queue)")
    s.option("--gateway-queue-timeout-s", 300.0, float, help="the longest a request waits for a drafter (then 503)")
    s.option("--gateway-tree", "adaptive", help="'adaptive' (draft policy) or a fixed tree k,N,D (alias: --tree, "
                                                "as in `tandem chat`)", aliases=("--tree",))
    s.option("--gateway-shadow", False, bool,
             help="with the adaptive gateway tree: shadow chains while decoding cloud-only (off: co-located drafters "
                  "would spend the server's cores on them)")
    s.option("--drafter", "default", help="'default' (pinned Qwen2.5-Coder-0.5B) or a GGUF path")
    s.option("--drafter-engine", "auto", help="auto | llama.cpp | onnx (as chat's)")
    s.option("--drafter-vocab", "", help="VocabTrim head vocabulary (.npy) for an onnx drafter")
    s.option("--drafter-learn-vocab", True, bool, help="re-rank the --drafter-vocab head from served traffic")
    s.option("--ngram", False, bool, help="graft prompt-lookup (n-gram) drafts onto the gateway's trees")
    s.option("--drafter-threads", 0, int, help="threads of each gateway drafter (0: half the cores, shared among "
                                               "the drafters)")


def _serve_security_options(s) -> None:
    """Metrics, TLS, keys, limits and shutdown."""
    s.option("--metrics-port", 0, int, help="Prometheus /metrics of the verifier on this port (0: off; the "
                                            "gateway serves /metrics on its own port)")
    s.option("--tls-cert", "", help="PEM certificate: TLS on gRPC and REST")
    s.option("--tls-key", "", help="PEM private key of --tls-cert")
    s.option("--tls-ca", "", help="PEM the remote --verifier's certificate chains to, or 'system' for the "
                                  "publicly trusted roots")
    s.option("--tls-server-name", "", help="name the verifier's certificate carries, if not its address")
    s.option("--allow-unauthenticated", False, bool, help="serve off loopback without API keys (trusted networks)")
    s.option("--key-concurrency", 0, int, help="REST generations at once per API key (0: unlimited)")
    s.option("--key-tokens-per-minute", 0, int,
             help="REST prompt + completion tokens per API key and minute, /tokenize and /detokenize included "
                  "(0: unlimited)")
    s.option("--key-sessions", 0, int, help="gRPC sessions at once per verifier key (0: unlimited; gateway keys, "
                                            "TANDEM_GATEWAY_KEYS, are exempt)")
    s.option("--key-prefill-tokens-per-minute", 0, int,
             help="prompt tokens one verifier key's sessions may prefill per minute (0: unlimited)")
    s.option("--session-lifetime-s", 0.0, float, help="longest a gRPC session may live (0: unlimited)")
    s.option("--teacher-mb", 0.0, float,
             help="keep the target's top-16 at each committed position of the tenants whose verifier keys are in "
                  "TANDEM_TEACH_KEYS (for distilling the drafter), up to this many MB per tenant (0: off)")
    s.option("--teacher-tenant-mb", 0.0, float, help="kept positions of one verifier key's partitions together "
                                                      "(0: 4 x --teacher-mb); least recently written first out")
    s.option("--teacher-total-mb", 0.0, float, help="kept positions of every tenant together (0: 16 x --teacher-mb)")
    s.option("--teacher-age-h", 24.0, float, help="how long kept positions live (--teacher-mb), and adapters "
                                                  "trained on them (--distill-drafter); swept every minute")
    s.option("--distill-drafter", "", help="distil a LoRA adapter for this drafter (GGUF, Hugging Face directory or "
                                           "'default') from each opted-in tenant's kept positions while the "
                                           "verifier is idle, and offer it to that tenant's edges (torch extra)")
    s.option("--distill-min-positions", 512, int, help="new positions a tenant keeps before its next adapter")
    s.option("--distill-budget-s", 300.0, float, help="compute seconds one adapter's training may take")
    s.option("--distill-tenant-adapters", 4, int, help="partitions of one verifier key that may hold an adapter and "
                                                       "its training state (least recently used out first)")
    s.option("--distill-max-adapters", 16, int, help="partitions of every tenant together that may hold one")
    s.option("--distill-dir", "", help="keep each tenant's adapter and its training state in this directory, so "
                                       "they outlive a restart (default: in memory only)")
    s.option("--stream-inbox", 8, int, help="requests one gRPC stream buffers before flow control pushes back")
    s.option("--max-body-bytes", 1 << 20, int, help="largest REST request body (413 above)")
    s.option("--public-metrics", False, bool,
             help="serve the gateway's /metrics without a key (else it needs one of TANDEM_METRICS_KEYS)")
    s.option("--docs", False, bool, help="serve the gateway's /docs and /openapi.json")
    s.option("--chat-page", True, bool, help="serve the web chat page at /chat (it shows speculation live)")
    s.option("--browser-drafter", False, bool,
             help="serve the drafter's self-contained ONNX export to browsers (exported once, cached): the chat "
                  "page's 'draft in this browser'")
    s.option("--cors-origins", "", help="browser origins allowed to call the REST API, comma-separated "
                                        "(e.g. https://app.example); none by default")
    s.option("--max-streams", 256, int, help="gRPC session streams at once (RESOURCE_EXHAUSTED beyond)")
    s.option("--drain-s", 30.0, float, help="on SIGTERM, how long open sessions get to finish")
    s.option("--otlp-endpoint", "", help="export OpenTelemetry traces over OTLP/gRPC to this endpoint (otel extra; "
                                         "OTEL_EXPORTER_OTLP_ENDPOINT works too)")


def _chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat through a running verifier (interactive without a prompt)")
    c.add_argument("prompt", nargs="?", default="", help="answer this one prompt and exit")
    c.option("--verifier", "127.0.0.1:50051", help="verifier address (gRPC; alias: --server)", aliases=("--server",))
    c.option("--tls-ca", "", help="PEM the verifier's certificate chains to (TLS), or 'system' for the "
                                  "publicly trusted roots")
    c.add_argument("--stats", action="store_true", help="print statistics after every answer")
    _add_chat_args(c)


def _drafter_parser(sub) -> None:
    dr = sub.add_parser("drafter", help="drafter engines: ONNX export, VocabTrim heads")
    dsub = dr.add_subparsers(dest="drafter_command", required=True)
    ex = dsub.add_parser("export", help="export the drafter to ONNX (cached by source hash)")
    ex.add_argument("--drafter", default="default", help="'default', a GGUF path or an HF directory")
    ex.add_argument("--quant", default="int4", choices=("int4", "int8", "dynamic-int8", "fp32"),
                    help="dynamic-int8: the browser's (onnxruntime-web runs it fast; with --self-contained)")
    ex.add_argument("--force", action="store_true", help="re-export even if cached")
    ex.add_argument("--self-contained", action="store_true",
                    help="one model.onnx, token ids in and logits out, with tokenizer.json beside it (browsers, "
                         "apps; a Qwen2 GGUF)")
    vt = dsub.add_parser("vocabtrim", help="choose a drafter head vocabulary (declared corpus + the target's own "
                                                 "outputs)")
    size = vt.add_mutually_exclusive_group()
    size.add_argument("--k", type=int, help="keep the K highest-ranked ids")
    size.add_argument("--coverage", type=float, help="keep the fewest ids covering this fraction of the counts")
    size.add_argument("--heldout-coverage", type=float, default=0.98,
                      help="(default) the smallest K covering this fraction of the target's own outputs")
    vt.add_argument("--target", default="default")
    vt.add_argument("--code-prompts", type=int, default=40, help="HumanEval calibration prompts (first half)")
    vt.add_argument("--chat-prompts", type=int, default=40, help="ShareGPT calibration prompts (first 100)")
    vt.add_argument("--max-new-tokens", type=int, default=128)
    vt.add_argument("--threads", type=int, default=0)
    vt.add_argument("--out", type=Path, required=True, help=".npy file of sorted ids (for --vocab)")


def _health_parser(sub) -> None:
    h = sub.add_parser("health", help="exit 0 if a verifier or gateway answers (container healthchecks)")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", help="verifier address host:port (gRPC Health)")
    target.add_argument("--http", help="URL, e.g. http://127.0.0.1:8000/readyz")
    h.add_argument("--tls-ca", default="", help="PEM the server's certificate chains to (gRPC TLS, or https), "
                                                "or 'system' for the publicly trusted roots")
    h.add_argument("--timeout", type=float, default=3.0)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="fetch models, start a local verifier, answer one prompt through it cloud-only "
                                     "and with Tandem, side by side")
    d.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    d.add_argument("--target", default="default")
    d.add_argument("--stats", action="store_true", default=True, help=argparse.SUPPRESS)
    d.add_argument("--tls-ca", default="", help=argparse.SUPPRESS)
    _add_chat_args(d)

