"""`python -m nanoref.serve [MODEL]`: an OpenAI-compatible server (nanoref/serving/api_server.py) on one LLM.

    python -m nanoref.serve --device cpu --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "Beautiful is better than", "max_tokens": 16, "temperature": 0}'

LoRA adapters (vLLM's flags): `--enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat`; a request's
"model" then names an adapter (or the base model), and /v1/models lists them all.

Tool calls (vLLM's flags): `tools` with tool_choice "required" or a named function need none; the model's own choice,
tool_choice "auto" (the default when tools are given), needs `--enable-auto-tool-choice --tool-call-parser hermes`.

The other flags are vLLM's too, where nanoref has the feature (`--model`, `--max-model-len`, `--seed`,
`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`, `--api-key`, ...): a script written for
`vllm serve` runs; a flag nanoref lacks is refused (argparse's error), never ignored.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import socket
import sys
import threading

from nanoref.llm import DEFAULT_MODEL
from nanoref.utils.flags import add_engine_flags, dashed_flags, engine_settings, name_the_flag

ENGINE_PROCESS = {"auto": None, "on": True, "off": False}  # --engine-process -> AsyncLLM.from_model's engine_process
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]  # vLLM's --uvicorn-log-level choices
API_KEY_VARIABLES = ("VLLM_API_KEY", "NANOREF_API_KEY")  # --api-key's default, in this order
# vLLM's CORS flags that take a JSON list (and --allow-credentials): build_app's settings of the same names
CORS_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")
# the engine settings whose flag is the setting's name in vLLM's spelling (--max-num-seqs -> max_num_seqs), passed
# to the engine only when given: the engine's own defaults (per device) apply otherwise (and beside them the flags
# both command lines take: flags.py's engine_settings)
ENGINE_SETTINGS = (
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    # vLLM's engine arguments (EngineConfig says what each does in nanoref)
    "kvcache_block_size",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "async_scheduling",
    "max_logprobs",
    "tokenizer",
    "tokenizer_mode",
    "generation_config",
    "revision",
    "tokenizer_revision",
    "download_dir",
    "load_format",
    "quantization",
    "swap_space",
    "max_seq_len_to_capture",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanoref.serve",
        description="Serve a Qwen3 model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
        "/v1/models), plus /health (and /ping), Prometheus /metrics and vLLM's /tokenize, /detokenize and /version. "
        "Without MODEL it serves the tiny built-in model.",
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="a local Hugging Face Qwen3 folder (default: the tiny built-in model)"
    )
    parser.add_argument(
        "--model", dest="model_option", default=None, metavar="MODEL", help="MODEL as an option (vLLM's spelling too)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine; vLLM's default is every interface)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name(s) in the API: a request may give any, responses name the first, as vLLM's (default: "
        "MODEL as given; nanoref/default_model for the built-in one)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.001,
        help="seconds a Python thread may hold the GIL while another waits (default 0.001; the interpreter's own "
        "is 0.005): the engine thread's host work between forwards must not wait that long for the event loop",
    )
    parser.add_argument(
        "--engine-process",
        choices=sorted(ENGINE_PROCESS),
        default="auto",
        help="run the engine in a process of its own, apart from the HTTP server's (default auto: on, on a CPU as on "
        "CUDA: the server's Python work would otherwise hold back the engine's steps)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer API_KEY` on the /v1 routes (a request without it: 401), as vLLM's; "
        "/health, /ping, /metrics, /version, /tokenize and /detokenize stay open, as in vLLM (default: the "
        f"environment's {' or '.join(API_KEY_VARIABLES)}, as vLLM reads the first; else no key)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="warning",
        help="uvicorn's log level (default warning: errors only, no access log; vLLM's default is info)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0,
        metavar="SECONDS",
        help="how long a stop (Ctrl-C, SIGTERM) lets the requests in flight finish before it aborts them (each "
        "response ends with a 503), as vLLM's (default 0: at once)",
    )
    parser.add_argument(
        "--disable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted for vLLM's scripts: nanoref never logs requests",
    )
    parser.add_argument(
        "--disable-log-stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted for vLLM's scripts: nanoref never logs stats (they are served at /metrics)",
    )
    engine = parser.add_argument_group("engine")
    add_engine_flags(engine)
    engine.add_argument(
        "--block-size",
        dest="kvcache_block_size",
        type=int,
        default=None,
        help="tokens per KV block: a power of two from 16 to 256 (16 unless flash-attn serves: then 256)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the K/V of a prompt prefix another request computed (default on; --no-enable-prefix-caching: "
        "every request, and each of its n samples, computes its whole prompt)",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill a prompt longer than what is left of a step's token budget in chunks (default on; "
        "--no-enable-chunked-prefill: every prompt whole, in one step, which needs --max-num-batched-tokens >= "
        "--max-model-len)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each decode step while the device runs the one before (default: on for CUDA)",
    )
    engine.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="the most logprobs (top_logprobs) or prompt_logprobs a request may ask for, 0 to 20 (default 20)",
    )
    engine.add_argument(
        "--tokenizer", default=None, metavar="FOLDER", help="a tokenizer folder other than MODEL's (default: MODEL's)"
    )
    engine.add_argument(
        "--tokenizer-mode",
        default=None,
        help="auto or hf (the fast tokenizer where the folder has one; default), or slow",
    )
    engine.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted for vLLM's scripts: nanoref runs no code from a model folder, trusted or not",
    )
    engine.add_argument(
        "--download-dir", default=None, help="accepted for vLLM's scripts: nanoref never downloads (MODEL is a folder)"
    )
    engine.add_argument(
        "--load-format", default=None, help="auto or safetensors (the same: nanoref reads *.safetensors only)"
    )
    engine.add_argument(
        "--revision", default=None, help="refused: a Hugging Face Hub version; nanoref loads local folders only"
    )
    engine.add_argument(
        "--tokenizer-revision",
        default=None,
        help="refused: a Hugging Face Hub version; nanoref loads local folders only",
    )
    engine.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="refused: nanoref runs unquantized weights only (see --kv-cache-dtype)",
    )
    engine.add_argument(
        "--swap-space",
        type=float,
        default=None,
        help="accepted for vLLM's scripts: a preempted request is recomputed, never swapped to the host",
    )
    engine.add_argument(
        "--max-seq-len-to-capture",
        type=int,
        default=None,
        help="accepted for vLLM's scripts: a decode CUDA graph serves every length up to --max-model-len",
    )
    engine.add_argument(
        "--compilation-config",
        "-O",
        default=None,
        help="refused: nanoref has no compilation settings (--enforce-eager turns decode CUDA graphs off)",
    )
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"model": DRAFT_FOLDER, "num_speculative_tokens": 4}\' (default: off)',
    )
    engine.add_argument(
        "--generation-config",
        default=None,
        metavar="auto|vllm|FOLDER",
        help="the defaults of the sampling fields a request leaves out: auto (the model's generation_config.json: "
        "its temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; default), vllm (SamplingParams' "
        "own), or a folder whose generation_config.json serves instead",
    )
    engine.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults laid over the generation config's, e.g. '{\"temperature\": 0.5}'; its "
        "max_new_tokens caps every request's max_tokens",
    )
    engine.add_argument(
        "--disable-cascade-attn",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="read a prefix that many requests share (a system prompt) once per sequence, not once for many",
    )
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters (PEFT folders) per request",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve, each under its name (a request's \"model\"): NAME=PATH, or vLLM's JSON form "
        '\'{"name": NAME, "path": PATH}\'; needs --enable-lora',
    )
    lora.add_argument("--max-loras", type=int, default=None, help="adapters one batch mixes (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept on the host (default max-loras)")
    tools = parser.add_argument_group("tool calls")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='let the model choose whether to call a tool (tool_choice "auto", the default with tools); needs '
        "--tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are read out of the model's text: hermes (Qwen3's <tool_call> blocks)",
    )
    tools.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='leave the tools out of the prompt of a request with tool_choice "none" (default: rendered, as vLLM)',
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every response carries X-Request-Id: the request's own header, else a fresh id (vLLM's flag)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served (vLLM's flag)",
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every stream's chunks carry their usage so far and it ends with a usage chunk, as if it asked for "
        "stream_options include_usage and continuous_usage_stats (vLLM's flag)",
    )
    cors = parser.add_argument_group("CORS (which web pages may call the server from a browser)")
    for name in CORS_LISTS:
        flag = "--" + name.replace("_", "-")
        cors.add_argument(flag, default=None, metavar="JSON", help=f'a JSON list of {name[8:]} (default ["*"])')
    cors.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="allow credentials (cookies, default: no)",
    )
    chat = parser.add_argument_group("chat")
    chat.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself on one line) in place of the model folder's",
    )
    chat.add_argument(
        "--chat-template-content-format",
        default="auto",
        help="auto or string: a message's text parts reach the template as one string (openai is refused)",
    )
    return parser


def load_chat_template(value: str) -> str:
    """--chat-template's template, as vLLM reads the flag: a file's text, or the value itself where it holds Jinja's
    characters ({, } or a newline; escapes such as \\n decoded); ValueError for a file that cannot be read, or a
    template that does not parse."""
    from nanoref.engine.chat import check_chat_template

    try:
        with open(value, encoding="utf-8") as file:
            template = file.read()
    except (OSError, UnicodeDecodeError) as error:
        if not any(char in value for char in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read: {error}"
            ) from None
        template = codecs.decode(value, "unicode_escape")
    try:
        return check_chat_template(template)
    except ValueError as error:
        raise ValueError(f"--chat-template: {error}") from None


def json_flag(text: str | None, flag: str, kind: type[dict] | type[list]) -> dict | list[str] | None:
    """A flag's JSON value (None: the flag was not given): an object for `dict`, a list of strings for `list`;
    ValueError naming the flag."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{flag} is not valid JSON ({error}): {text!r}") from None
    if kind is dict and not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    if kind is list and (not isinstance(value, list) or not all(isinstance(item, str) for item in value)):
        raise ValueError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


class Terminated(Exception):
    """SIGTERM arrived (and uvicorn, which had it first, has shut the server down)."""


def check_serves_text_before_loading(model: str, settings: dict) -> None:
    """A folder without a tokenizer refused before an engine loads the model (`check_serves_text`); a setting the
    config refuses is left for `AsyncLLM.from_model` to raise, as it does for every other setting."""
    from nanoref.config import EngineConfig
    from nanoref.serving.api_server import check_serves_text

    try:
        config = EngineConfig(model, **settings)
    except (ValueError, TypeError):
        return
    check_serves_text(config)


def api_key_from_environment() -> str | None:
    """--api-key's default: VLLM_API_KEY (vLLM's variable), else NANOREF_API_KEY; unset or empty: no key."""
    return next((os.environ[name] for name in API_KEY_VARIABLES if os.environ.get(name)), None)


def _terminated(signum, frame) -> None:
    raise Terminated


LAST_WORDS_S = 1.0  # after a stop's abort, how long a client that reads has to take its request's last event


def bounded_shutdown(server_class: type, timeout: float, abort_all=None) -> type:
    """uvicorn's Server whose shutdown lets the responses in flight go on for at most `timeout` seconds, then ends
    them as vLLM's does: `abort_all()` (an async callable) aborts every request in flight, so that each response
    ends with its error (a 503, streamed or not) and its blocks are freed; a connection still open LAST_WORDS_S
    later (a client that stopped reading) is cut. Left to itself, uvicorn waits for every response to end, for ever
    when a client stopped reading its stream."""
    import asyncio

    class Server(server_class):
        async def shutdown(self, sockets=None) -> None:
            async def cut() -> None:
                await asyncio.sleep(timeout)
                connections = self.server_state.connections
                if abort_all is not None and connections:
                    await abort_all()
                    deadline = asyncio.get_running_loop().time() + LAST_WORDS_S
                    while connections and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.02)
                for connection in list(connections):
                    connection.transport.abort()  # (close() would wait to send what a stalled client never reads)

            cutter = asyncio.ensure_future(cut())
            try:
                await super().shutdown(sockets)
            finally:
                cutter.cancel()

    return Server


def keep_alive_on_engine_death() -> bool:
    """vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH (an integer, 0 by default; empty is unset): nonzero keeps the server
    up, answering 503, once its engine died. Another value is a ValueError naming the variable (vLLM's int() fails
    on it too), not a setting silently read as 0."""
    value = os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "").strip()
    try:
        return bool(int(value or 0))
    except ValueError:
        message = f"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH must be an integer (1: keep the server up), got {value!r}"
        raise ValueError(message) from None


def stop_when_the_engine_dies(
    engine, server, stopped: threading.Event, poll: float = 0.25
) -> tuple[threading.Event, threading.Thread]:
    """vLLM's watchdog: once the engine died (its process killed, say), say why on stderr and stop the server, whose
    requests in flight have failed already, so that a supervisor sees it end and can start it again; until it
    stops, /health answers 503 -> (an event set when that happened, the watchdog's thread). `stopped`: the server
    ended otherwise (the engine is closed after it is set). An engine that ends while the server stops already (a
    SIGTERM sent to the whole process group, as systemd sends it, reaches the engine process too) is no death."""
    died = threading.Event()

    def watch() -> None:
        while not stopped.wait(poll):
            # (errored read first: a clean stop sets `stopped`, then closes the engine, which makes it errored)
            if engine.errored and not (stopped.is_set() or server.should_exit):
                print(f"error: {engine.dead_error}; the server stops", file=sys.stderr, flush=True)
                died.set()
                server.should_exit = True
                return

    watchdog = threading.Thread(target=watch, name="nanoref-engine-watchdog", daemon=True)
    watchdog.start()
    return died, watchdog


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after a clean stop (Ctrl-C, also while the model loads), 1 when the engine died (vLLM's server
    stops then too, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set), 2 bad input (arguments, model folder, an address
    in use). On SIGTERM it stops as on Ctrl-C (the server, then the engine), then ends by that signal, as uvicorn
    does."""
    try:
        return _serve(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (the model loading, say): a stop, not a traceback
        return 0


def _serve(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(dashed_flags(sys.argv[1:] if argv is None else argv))  # (--max_model_len too, as vLLM)
    if args.model_option is not None and args.model is not None and args.model_option != args.model:
        parser.error(f"the model is given twice: {args.model!r} and --model {args.model_option!r}")
    model = args.model_option or args.model or str(DEFAULT_MODEL)
    if args.api_key is not None and not args.api_key:
        print("error: --api-key must not be empty (leave it out to serve without a key)", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else api_key_from_environment()
    try:
        speculative_config = json_flag(args.speculative_config, "--speculative-config", dict)
        cors = {name: json_flag(getattr(args, name), "--" + name.replace("_", "-"), list) for name in CORS_LISTS}
        override_generation_config = json_flag(args.override_generation_config, "--override-generation-config", dict)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not 0 < args.switch_interval <= 1:
        print(f"error: --switch-interval must be in (0, 1] seconds, got {args.switch_interval}", file=sys.stderr)
        return 2
    if not 0 <= args.shutdown_timeout < float("inf"):
        print(f"error: --shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}", file=sys.stderr)
        return 2
    try:
        keep_alive = keep_alive_on_engine_death()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:  # (checked before the model loads, as every argument is)
        print(f"error: --port must be in [0, 65535] (0: any free port), got {args.port}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from nanoref.engine.chat import check_content_format
        from nanoref.serving.api_server import build_app
        from nanoref.serving.async_llm import AsyncLLM
        from nanoref.serving.lora_modules import LoRAModules, parse_lora_modules, served_model_names
        from nanoref.serving.tool_calls import check_tool_settings
        from nanoref.utils.heap import freeze_heap
    except ImportError as error:
        print(f"error: {error.name} is missing: pip install 'nanoref[serve]'", file=sys.stderr)
        return 2
    try:
        names = served_model_names(args.served_model_name) if args.served_model_name else []
        names = names or ["nanoref/default_model" if model == str(DEFAULT_MODEL) else model]
    except ValueError as error:
        print(f"error: --served-model-name: {error}", file=sys.stderr)
        return 2
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
        if lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        check_tool_settings(args.enable_auto_tool_choice, args.tool_call_parser)
        check_content_format(args.chat_template_content_format)
        chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = {
        **engine_settings(args),
        "disable_cascade_attn": args.disable_cascade_attn,
        **({"enable_lora": True} if args.enable_lora else {}),
        **({"trust_remote_code": True} if args.trust_remote_code else {}),
        **({"compilation_config": args.compilation_config} if args.compilation_config is not None else {}),
        **({"speculative_config": speculative_config} if speculative_config is not None else {}),
        **({"override_generation_config": override_generation_config} if override_generation_config else {}),
        **{name: getattr(args, name) for name in ENGINE_SETTINGS if getattr(args, name) is not None},
    }
    try:
        # bind first, before the model loads: an address in use (or a host that is none of this machine's) is a
        # clear error at once, and --port 0 can say which port it got
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET  # (an IPv6 address: ::1, ::; as uvicorn's)
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2
    # SIGTERM while the model loads: the load is stopped as by Ctrl-C (the engine process ended, not left loading
    # the model on its own), then the process ends by the signal
    loading = signal.signal(signal.SIGTERM, _terminated)
    try:
        check_serves_text_before_loading(model, settings)
        engine = AsyncLLM.from_model(model, engine_process=ENGINE_PROCESS[args.engine_process], **settings)
    except (ValueError, TypeError, RuntimeError) as error:  # (ModelFolderError is a ValueError)
        sock.close()
        print(f"error: {name_the_flag(parser, str(error))}", file=sys.stderr)
        return 2
    except Terminated:
        sock.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, loading)
    name = names[0]
    tool_settings = {
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
    }
    try:  # every adapter's folder checked against the model, and the app built, before the server listens
        adapters = LoRAModules(engine.config, names, lora_modules)
        app = build_app(
            engine,
            names,
            lora_modules=adapters,
            api_key=api_key,
            chat_template=chat_template,
            enable_request_id_headers=args.enable_request_id_headers,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_force_include_usage=args.enable_force_include_usage,
            allow_credentials=args.allow_credentials,
            **{name: value for name, value in cors.items() if value is not None},
            **tool_settings,
        )
    except ValueError as error:  # (LoRAAdapterError too): the engine is made already, so it is closed
        engine.close()
        sock.close()
        print(f"error: {error}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # (a URL's IPv6 address is in brackets)
    print(f"nanoref serves {name!r} on http://{host}:{port}/v1 (Ctrl-C stops it)", flush=True)
    defaults = engine.config.generation_defaults.sampling
    if defaults:  # (as vLLM says it: a client may not expect the model's temperature)
        listed = ", ".join(f"{key}={value}" for key, value in defaults.items())
        print(
            f"sampling defaults from the model's generation config (--generation-config vllm: none): {listed}",
            flush=True,
        )
    server = bounded_shutdown(uvicorn.Server, args.shutdown_timeout, engine.abort_all)(
        uvicorn.Config(app, log_level=args.uvicorn_log_level)
    )
    # This process is the server's own: threads share its GIL, the event loop streaming responses and the engine
    # thread stepping (or, with the engine in its own process, the thread reading its messages). A thread that
    # wants the GIL waits up to the switch interval for the other to let go, and the engine thread wants it back
    # after every wait for the device.
    sys.setswitchinterval(args.switch_interval)
    freeze_heap()  # what start-up made (the app, the tokenizer; the model too with the engine thread): heap.py
    # uvicorn takes SIGINT and SIGTERM while it runs, shuts down, then raises the signal again with the handlers
    # it found: Ctrl-C as KeyboardInterrupt, SIGTERM as Terminated (by default SIGTERM would end the process here,
    # the engine left unclosed)
    previous = signal.signal(signal.SIGTERM, _terminated)
    terminated = False
    stopped = threading.Event()
    died, watchdog = (threading.Event(), None) if keep_alive else stop_when_the_engine_dies(engine, server, stopped)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn hands Ctrl-C back once it has shut down: that is the clean stop
        pass
    except Terminated:
        terminated = True
    finally:
        stopped.set()
        if watchdog is not None:
            watchdog.join()
        signal.signal(signal.SIGTERM, previous)
        engine.close()
        sock.close()
    if died.is_set():
        return 1
    if terminated:  # end by the signal, as uvicorn does (a supervisor reads the exit status; a shell says 143)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
