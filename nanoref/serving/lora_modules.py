"""The server's LoRA adapters, by name: what `--lora-modules name=path` serves and a request's `model` picks.

As in vLLM: the request's `model` is the base model's served name (no adapter) or an adapter's name; any other is
a 404. `/v1/models` lists the base model, then one card per adapter (`root`: its folder, `parent`: the base
model). With the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vLLM's opt-in; NANOREF_ALLOW_...
works too) `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}` change the list while the server runs (`"load_inplace": true` replaces a loaded adapter's folder):
off by default, because whoever can reach the server could then make it read any folder on its machine.

Every adapter is read and checked here against the engine's model before it is listed (a bad folder is a clear
error at start-up, or a 400 from load_lora_adapter), so requests never meet a folder the engine cannot serve. The
engine reads it again when a request first needs it (its own host cache, `max_cpu_loras`). Each name gets a new
`lora_int_id` (never reused), so an adapter unloaded and loaded again from another folder is another adapter to
the engine and its prefix cache. Unloading removes the name: requests in flight finish under the adapter.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from itertools import count

from fastapi import Request
from fastapi.responses import PlainTextResponse
from prometheus_client import Counter

from nanoref.config import EngineConfig
from nanoref.llm import LoRARequest, check_lora_adapter

RUNTIME_UPDATES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "NANOREF_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATES)


def parse_lora_modules(values: list[str]) -> dict[str, str | tuple[str, str]]:
    """--lora-modules' entries -> {name: path}: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`, whose
    `base_model_name`, if given, makes the entry (path, base_model_name): vLLM's label for the adapter's base, shown
    as its card's `parent` in /v1/models whatever it names (as vLLM shows it). ValueError naming a malformed or
    repeated one."""
    modules: dict[str, str | tuple[str, str]] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            name, path = _json_lora_module(value)
        else:
            name, sep, path = value.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(
                    f'--lora-modules takes name=path entries (or {{"name": ..., "path": ...}}), got {value!r}'
                )
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _json_lora_module(value: str) -> tuple[str, str | tuple[str, str]]:
    try:
        entry = json.loads(value)
    except ValueError as error:
        raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({error})") from None
    unknown = sorted(set(entry) - {"name", "path", "base_model_name"}) if isinstance(entry, dict) else None
    if unknown is None or unknown:
        raise ValueError(f'--lora-modules: {value!r} takes "name", "path" and "base_model_name" only')
    name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
    if not (isinstance(name, str) and name.strip() and isinstance(path, str) and path.strip()):
        raise ValueError(f'--lora-modules: {value!r} needs a "name" and a "path" (non-empty strings)')
    if base is not None and not (isinstance(base, str) and base.strip()):
        raise ValueError(f'--lora-modules: {value!r}: "base_model_name" must be a non-empty string or null')
    return name, path if base is None else (path, base)


def served_model_names(served_model_name: str | list[str]) -> list[str]:
    """The base model's served names as a list (one name, or several as vLLM's --served-model-name takes them);
    ValueError naming an empty or repeated one."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise ValueError(f"served model names must be non-empty strings, got {served_model_name!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"a served model name is given twice: {names!r}")
    return names


class LoRAModules:
    """name -> LoRARequest, each checked against the engine's model when added."""

    def __init__(
        self,
        config: EngineConfig,
        served_model_name: str | list[str],
        modules: dict[str, str | tuple[str, str]] | None = None,
    ) -> None:
        # the base model's names (vLLM's --served-model-name takes several): a request may give any; responses,
        # cards' parent and metrics use the first
        self.names = served_model_names(served_model_name)
        self.config, self.base = config, self.names[0]
        self.adapters: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self.parents: dict[str, str] = {}  # an adapter's card's `parent`, where --lora-modules named its base
        self._ids = count(1)
        self.num_requests = None  # the server's per-adapter request counter (`lora_routes` makes it)
        for name, entry in (modules or {}).items():
            path, parent = (entry, None) if isinstance(entry, str) else entry
            self.add(name, path, parent)

    def add(self, name: str, path: str, parent: str | None = None, replace: bool = False) -> LoRARequest:
        """Check the folder and list it under `name` (ValueError: a name in use, LoRAAdapterError: the folder);
        parent: its card's `parent` (None: the base model's first name); replace: an adapter of that name is
        replaced once the new folder checks out (vLLM's load_inplace; requests in flight finish under the old one)."""
        self.check_name(name, replace)
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path must be a non-empty string")
        request = LoRARequest(name, next(self._ids), path)
        check_lora_adapter(self.config, request)
        self.adapters[name], self.created[name] = request, int(time.time())
        if parent is not None:
            self.parents[name] = parent
        return request

    def check_name(self, name: str, replace: bool = False) -> None:
        """ValueError unless an adapter may be added under `name` (`add`'s checks before it reads the folder)."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need the engine's enable_lora (--enable-lora)")
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        if name in self.names:
            raise ValueError(f"{name!r} is the base model's name, not an adapter's")
        if name in self.adapters and not replace:
            raise ValueError(
                f"the LoRA adapter {name!r} has already been loaded (to load it again in place, set load_inplace)"
            )

    def remove(self, name: str) -> LoRARequest | None:
        self.created.pop(name, None)
        self.parents.pop(name, None)
        return self.adapters.pop(name, None)

    def resolve(self, model: object) -> LoRARequest | None | bool:
        """A request's `model` -> its adapter (None: the base model, or no model given); False: no such model."""
        if model is None or model in self.names:
            return None
        return self.adapters.get(model, False) if isinstance(model, str) else False

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a (checked) request's `model` names, counted in /metrics; None: the base model."""
        request = self.resolve(model) or None
        if request is not None and self.num_requests is not None:
            self.num_requests.labels(lora_name=request.lora_name).inc()
        return request

    def response_name(self, model: str | None) -> str:
        """The `model` a response names for a (checked) request's: the adapter's name, else the base model's first
        name (vLLM's, whichever of its names the request gave)."""
        return model if model in self.adapters else self.base

    def cards(self, base_card: dict) -> list[dict]:
        """/v1/models' data: a card for each of the base model's names, then each adapter's."""
        bases = [{**base_card, "id": name} for name in self.names]
        adapters = [
            {
                **base_card,
                "id": name,
                "created": self.created[name],
                "root": request.lora_path,
                "parent": self.parents.get(name, self.base),
            }
            for name, request in self.adapters.items()
        ]
        return [*bases, *adapters]


def lora_routes(app, adapters: LoRAModules, read_body: Callable, api_error: type[Exception], registry) -> None:
    """The per-adapter request counter in `registry`, and, where runtime updates are allowed, vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter on `app` (else they do not exist: a 404).
    read_body: the app's reader of a request's JSON object; api_error(message, param, status): its error."""
    adapters.num_requests = Counter(
        "nanoref_lora_requests", "Requests served under each LoRA adapter", ["lora_name"], registry=registry
    )
    if not runtime_updates_allowed():
        return
    lock = asyncio.Lock()  # one change at a time: a name is checked and listed as one step

    def field(body: dict, name: str, known: tuple[str, ...]) -> str:
        unknown = sorted(set(body) - set(known))
        if unknown:  # (rather than ignored: the client asked for something)
            raise api_error(
                f"unknown field {unknown[0]!r:.60} (this endpoint takes {', '.join(known)})", unknown[0], 400
            )
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise api_error(f"{name} must be a non-empty string, got {value!r}", name, 400)
        return value

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body, _ = await read_body(request)
        known = ("lora_name", "lora_path", "load_inplace")
        name, path = field(body, "lora_name", known), field(body, "lora_path", known)
        in_place = body.get("load_inplace")
        if in_place is not None and not isinstance(in_place, bool):
            raise api_error(f"load_inplace must be true or false, got {in_place!r:.60}", "load_inplace", 400)
        async with lock:
            try:
                adapters.check_name(name, bool(in_place))
            except ValueError as error:
                raise api_error(str(error), "lora_name", 400) from None
            try:  # (reading the folder is file work: off the event loop; a replaced adapter's parent is kept)
                await asyncio.to_thread(adapters.add, name, path, None, bool(in_place))
            except ValueError as error:  # (LoRAAdapterError: the folder is no adapter of this model)
                raise api_error(str(error), "lora_path", 400) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body, _ = await read_body(request)
        name = field(body, "lora_name", ("lora_name",))
        async with lock:
            if adapters.remove(name) is None:
                raise api_error(f"the LoRA adapter {name!r} cannot be found", "lora_name", 404)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
