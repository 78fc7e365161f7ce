"""LoRA adapters over HTTP, with OpenAI's own client on 127.0.0.1: the request's `model` picks the adapter,
/v1/models lists them (vLLM's cards), an unknown model is a 404, vLLM's runtime load/unload endpoints behind their
opt-in, per-adapter metrics, and `python -m nanoref.serve --enable-lora --lora-modules name=path`."""

from __future__ import annotations

import contextlib

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("peft", reason="peft is not installed (makes the random adapters)")

from nanoref import DEFAULT_MODEL, LLM, LoRARequest, SamplingParams  # noqa: E402
from nanoref.serving.api_server import serve_in_background  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402
from nanoref.serving.lora_modules import LoRAModules  # noqa: E402
from nanoref.testing import make_random_lora  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import Server  # noqa: E402

MODEL = "nanoref-base"
SETTINGS = dict(device="cpu", num_kvcache_blocks=128, enable_lora=True, max_loras=2)
PROMPT = "Beautiful is better than"
PARAMS = dict(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_lora")
    return {
        "sql": str(make_random_lora(root / "sql", DEFAULT_MODEL, rank=8, seed=21)),
        "chat": str(make_random_lora(root / "chat", DEFAULT_MODEL, rank=4, targets=("q_proj", "down_proj"), seed=22)),
        "late": str(make_random_lora(root / "late", DEFAULT_MODEL, rank=2, seed=23)),
    }


@contextlib.contextmanager
def lora_server(folders: dict[str, str], engine_process: bool = False, **settings):
    engine = AsyncLLM.from_model(engine_process=engine_process, **{**SETTINGS, **settings})
    try:
        adapters = LoRAModules(engine.config, MODEL, {"sql": folders["sql"], "chat": folders["chat"]})
        with serve_in_background(engine, MODEL, lora_modules=adapters) as url:
            yield Server(url, engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def server(folders):
    with lora_server(folders) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def offline_text(offline: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(ignore_eos=True, **PARAMS)
    return offline.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0]["text"]


def test_models_lists_the_base_model_and_every_adapter_with_its_parent(server, folders):
    cards = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"]
    assert [card["id"] for card in cards] == [MODEL, "sql", "chat"]
    for card in cards[1:]:
        assert card["parent"] == MODEL and card["root"] == folders[card["id"]] and card["object"] == "model"
    assert [m.id for m in server.client().models.list().data] == [MODEL, "sql", "chat"]


def test_an_adapters_base_model_name_is_its_cards_parent_whatever_it_names(server, folders):
    """vLLM's --lora-modules JSON form: `base_model_name` is a label /v1/models shows as the card's parent (vLLM
    checks it against nothing); an adapter without one has the served model as its parent."""
    modules = {"sql": (folders["sql"], "Qwen/Qwen3-0.6B"), "chat": folders["chat"]}
    adapters = LoRAModules(server.engine.config, MODEL, modules)
    cards = adapters.cards({"id": MODEL, "parent": None})
    assert [(card["id"], card["parent"]) for card in cards] == [
        (MODEL, None),
        ("sql", "Qwen/Qwen3-0.6B"),
        ("chat", MODEL),
    ]
    adapters.remove("sql")
    adapters.add("sql", folders["sql"])  # (loaded again without one: the served model's)
    assert [card["parent"] for card in adapters.cards({"id": MODEL, "parent": None})] == [None, MODEL, MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_requests_model_picks_its_adapter(server, offline, folders, stream):
    client = server.client()
    texts = {}
    requests = {"sql": LoRARequest("sql", 1, folders["sql"]), "chat": LoRARequest("chat", 2, folders["chat"])}
    for model, lora in [*requests.items(), (MODEL, None)]:
        args = dict(model=model, prompt=PROMPT, extra_body={"ignore_eos": True}, **PARAMS)
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks)
            assert {c.model for c in chunks} == {model}
        else:
            response = client.completions.create(**args)
            text = response.choices[0].text
            assert response.model == model
        assert text == offline_text(offline, lora), model
        texts[model] = text
    assert len(set(texts.values())) == 3, "each adapter should change the greedy text"
    server.wait_until_idle()


def test_chat_completions_take_the_adapter_too(server, offline, folders):
    messages = [{"role": "user", "content": "What is better?"}]
    got = server.client().chat.completions.create(model="sql", messages=messages, **PARAMS)
    want = offline.chat(
        messages, SamplingParams(**PARAMS), use_tqdm=False, lora_request=LoRARequest("sql", 1, folders["sql"])
    )
    assert got.choices[0].message.content == want[0]["text"]


def test_an_unknown_model_or_adapter_is_a_404_that_names_it(server):
    for model in ("gpt-4", "SQL"):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "x"}, timeout=TIMEOUT)
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and error["type"] == "NotFoundError"
        assert repr(model) in error["message"] and "'sql'" in error["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x", max_tokens=2)


def test_runtime_updates_are_off_unless_opted_in(server):
    body = {"lora_name": "x", "lora_path": "/tmp"}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=TIMEOUT).status_code == 404
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, timeout=TIMEOUT).status_code == 404


def test_metrics_count_requests_per_adapter(server):
    def count(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        line = next(
            (ln for ln in text.splitlines() if ln.startswith(f'nanoref_lora_requests_total{{lora_name="{name}"}}')),
            None,
        )
        return 0.0 if line is None else float(line.split()[-1])

    before = count("chat")
    for _ in range(2):
        server.client().completions.create(model="chat", prompt="x", max_tokens=2)
    server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert count("chat") == before + 2


def test_adapters_load_and_unload_at_runtime_where_allowed(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with lora_server(folders) as server:
        url, client = server.url, server.client()

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{url}/v1/{path}", json=body, timeout=TIMEOUT)

        response = post("load_lora_adapter", {"lora_name": "late", "lora_path": folders["late"]})
        assert response.status_code == 200 and "late" in response.text
        assert [m.id for m in client.models.list().data] == [MODEL, "sql", "chat", "late"]
        offline = LLM(**SETTINGS)
        want = offline_text(offline, LoRARequest("late", 3, folders["late"]))
        args = dict(prompt=PROMPT, extra_body={"ignore_eos": True}, **PARAMS)
        assert client.completions.create(model="late", **args).choices[0].text == want
        # a name in use, a folder that is no adapter, a missing field: 400s that say so
        again = post("load_lora_adapter", {"lora_name": "late", "lora_path": folders["late"]})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert again.json()["error"]["param"] == "lora_name"
        # vLLM's load_inplace: the name now serves the new folder (requests in flight finish under the old one)
        in_place = {"lora_name": "late", "lora_path": folders["sql"], "load_inplace": True}
        assert post("load_lora_adapter", in_place).status_code == 200
        sql = offline_text(offline, LoRARequest("sql", 1, folders["sql"]))
        assert sql != want and client.completions.create(model="late", **args).choices[0].text == sql
        assert post("load_lora_adapter", {**in_place, "lora_path": folders["late"]}).status_code == 200
        # a field the endpoint does not know is a 400 naming it, not ignored
        typo = post("load_lora_adapter", {"lora_name": "other", "lora_path": folders["late"], "load_in_place": True})
        assert typo.status_code == 400 and typo.json()["error"]["param"] == "load_in_place"
        (tmp_path / "empty").mkdir()
        bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "empty")})
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.json()["error"]["message"]
        assert post("load_lora_adapter", {"lora_name": "x"}).json()["error"]["param"] == "lora_path"
        assert [m.id for m in client.models.list().data] == [MODEL, "sql", "chat", "late"]
        # unloaded: no longer listed nor served; unloading it again is a 404
        assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 200
        assert [m.id for m in client.models.list().data] == [MODEL, "sql", "chat"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="late", **args)
        assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 404
        server.wait_until_idle()


def test_an_engine_process_serves_adapters(folders, offline):
    with lora_server(folders, engine_process=True) as server:
        args = dict(model="sql", prompt=PROMPT, extra_body={"ignore_eos": True}, **PARAMS)
        text = server.client().completions.create(**args).choices[0].text
        assert text == offline_text(offline, LoRARequest("sql", 1, folders["sql"]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "sql=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "sql"], "takes name=path entries"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be a positive integer"),
        (["--enable-lora", "--lora-modules", "sql=/no/such/folder"], "no such folder"),
        # vLLM's JSON form reaches the folder check too, whatever base model it names (vLLM's label, not checked)
        (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/no/such/folder"}'], "no such folder"),
        (
            ["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/x/none", "base_model_name": "other"}'],
            "no such folder",
        ),
        (
            ["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/x", "base_model_name": 5}'],
            '"base_model_name" must be a non-empty string',
        ),
        (["--enable-lora", "--lora-modules", '{"name": "sql"}'], 'needs a "name" and a "path"'),
        (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/x", "rank": 8}'], 'takes "name", "path"'),
        (["--enable-lora", "--lora-modules", '{"name": "sql", '], "is not valid JSON"),
    ],
)
def test_the_serve_command_refuses_bad_lora_flags(argv, message, capsys):
    from nanoref.serve import main

    assert main(["--device", "cpu", "--port", "0", "--engine-process", "off", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_lora_modules_take_vllms_json_form_beside_name_equals_path():
    from nanoref.serving.lora_modules import parse_lora_modules

    chat = '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'
    values = ["sql=/a/sql", chat, '{"name":"m","path":"/m"}']
    assert parse_lora_modules(values) == {"sql": "/a/sql", "chat": ("/a/chat", "base"), "m": "/m"}
    other = '{"name": "x", "path": "/a/x", "base_model_name": "Qwen/Qwen3-8B"}'  # (any name: vLLM's label)
    assert parse_lora_modules([other]) == {"x": ("/a/x", "Qwen/Qwen3-8B")}


def test_an_adapter_for_the_engine_needs_enable_lora():
    llm = LLM(device="cpu", num_kvcache_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        LoRAModules(llm.config, MODEL, {"a": "/x"})
