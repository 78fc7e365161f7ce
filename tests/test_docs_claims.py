"""What README.md and docs/*.md tell a user to type or rely on exists and is what the code does: the files and
tests they name, `LLM`'s signature and settings table, `SamplingParams`' defaults, the command lines' defaults, the
exercises' points, and their Python examples, run on the built-in model."""

from __future__ import annotations

import ast
import inspect
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from nanoref import LLM, SamplingParams
from nanoref.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text(name: str) -> str:
    return (ROOT / name).read_text()


def python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text(name), re.S)


# -- files and tests ------------------------------------------------------------------------------------------------
def test_every_test_file_and_test_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for match in re.finditer(r"tests/(test_\w+\.py)(?:::(\w+))?", doc.read_text()):
            path = ROOT / "tests" / match[1]
            if not path.is_file():
                missing.append(f"{doc.name}: {match[0]}")
            elif match[2] and not re.search(rf"^\s*def {match[2]}\b", path.read_text(), re.M):
                missing.append(f"{doc.name}: {match[0]} (no such test)")
    assert missing == []


def braces(path: str) -> list[str]:
    """`results/x.{json,md}` -> the paths it stands for, as the shell expands it."""
    group = re.search(r"\{([^{}]*)\}", path)
    if not group:
        return [path]
    return [p for alt in group[1].split(",") for p in braces(path[: group.start()] + alt + path[group.end() :])]


def test_every_repository_path_the_docs_quote_exists():
    missing = []
    for doc in DOCS:
        for quoted in re.findall(
            r"`((?:nanoref|tests|benchmarks|figures|notebooks|docs|\.ci)/[\w./*+{},-]*)`", doc.read_text()
        ):
            missing += [f"{doc.name}: {path}" for path in braces(quoted) if not list(ROOT.glob(path.rstrip("/")))]
    assert missing == []


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but - and _ dropped, spaces -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_of_the_readme_goes_to_a_file_and_its_heading():
    # (docs/*.md's links are checked in the built site, tests/test_docs.py; README.md is no page of it)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text("README.md")):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            broken.append(target)
        elif anchor and anchor not in heading_anchors(ROOT / path):
            broken.append(target)
    assert broken == []


def test_every_results_file_benchmarks_md_names_by_itself_is_in_benchmarks_results():
    # `beside_peer_h100_split.{json,md}`, `cuda_graphs_h200.json`: a results file named without its folder
    missing = [
        path
        for quoted in re.findall(r"`([\w-]+\.(?:json|md|\{json,md\}))`", text("docs/benchmarks.md"))
        for path in braces(quoted)
        if not (ROOT / "benchmarks" / "results" / path).is_file()
    ]
    assert missing == []


def test_every_class_attribute_the_docs_name_is_in_that_classs_body():
    # `LLMEngine.step`, `AsyncLLM.from_model`: the attribute is named in the body of the package's class of that name
    bodies: dict[str, str] = {}
    for path in (ROOT / "nanoref").rglob("*.py"):
        for name, body in re.findall(r"^class (\w+)\b(.*?)(?=^\S|\Z)", path.read_text(), re.M | re.S):
            bodies[name] = bodies.get(name, "") + body
    assert "LLMEngine" in bodies, "no class found: the pattern no longer matches how the package declares them"
    wrong = [
        f"{doc.name}: {cls}.{attr}"
        for doc in DOCS
        for cls, attr in re.findall(r"`([A-Z]\w+)\.(\w+)", doc.read_text())
        if cls in bodies and not re.search(rf"\b{attr}\b", bodies[cls])
    ]
    assert wrong == []


def test_every_environment_variable_the_package_reads_is_documented():
    # the package reads a variable by its name, a string (NANOREF_DEVICE, VLLM_API_KEY, ...); .ci's scripts as $NAME
    read = {
        name
        for path in (ROOT / "nanoref").rglob("*.py")
        for name in re.findall(r"[\"']((?:NANOREF|VLLM)_[A-Z][A-Z0-9_]*)[\"']", path.read_text())
    }
    read |= {name for path in (ROOT / ".ci").iterdir() for name in re.findall(r"\$\{?(NANOREF_\w+)", path.read_text())}
    assert read, "no environment variable found: the pattern no longer matches how the code names them"
    documented = "".join(doc.read_text() for doc in DOCS)
    assert sorted(name for name in read if f"`{name}" not in documented) == []


def layout_sections() -> dict[str, str]:
    """layout.md's tree of nanoref/: each entry at its indentation ("engine/", "llm.py") -> its text."""
    tree = re.search(r"```\nnanoref/\n(.*?)\n(?=\S)", text("docs/layout.md"), re.S)[1]
    sections: dict[str, str] = {}
    for line in tree.splitlines():
        if entry := re.match(r"  (\S+)\s", line):
            name = entry[1]
        sections[name] = sections.get(name, "") + line
    return sections


def test_layout_md_names_every_module_of_the_package():
    sections = layout_sections()
    missing = []
    for path in sorted((ROOT / "nanoref").rglob("*.py")):
        parts = path.relative_to(ROOT / "nanoref").parts
        if path.stem == "__init__" or "default_model" in parts:
            continue
        if len(parts) == 1:  # an entry of its own, or named in another's (serve.py in serving/'s)
            named = path.name in sections or re.search(rf"(?<![\w/]){re.escape(path.name)}", "".join(sections.values()))
        else:  # in its folder's entry, by file name or module name (a kernel's "_triton" twin as "+ _triton")
            section = sections.get(f"{parts[0]}/", "")
            named = (
                bool(re.search(rf"\b{path.stem}\b", section))
                or (path.stem.endswith("_triton") and "+ _triton" in section)
                or (path.stem == "__main__" and f"python -m nanoref.{parts[0]}" in section)
            )
        if not named:
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == []


def test_layout_md_names_every_benchmark_script():
    entry = re.search(r"^benchmarks/ (.*?)\n(?=\S)", text("docs/layout.md"), re.S | re.M)
    assert entry, "docs/layout.md no longer has a benchmarks/ entry"
    named = set(re.findall(r"\b(\w+\.py)\b", entry[1]))
    assert sorted(path.name for path in (ROOT / "benchmarks").glob("*.py") if path.name not in named) == []


def test_every_route_of_the_server_is_documented():
    routes = {
        path
        for module in (ROOT / "nanoref" / "serving").glob("*.py")
        for path in re.findall(r"@app\.(?:get|post|put|delete|api_route)\(\"([^\"]+)\"", module.read_text())
    }
    assert "/v1/completions" in routes, "no route found: the pattern no longer matches how the server declares them"
    documented = "".join(doc.read_text() for doc in DOCS)
    assert sorted(path for path in routes if not re.search(rf"{re.escape(path)}(?![\w/])", documented)) == []


def test_the_serve_commands_help_names_every_route_it_always_serves():
    # (the dev-mode route needs VLLM_SERVER_DEV_MODE; LoRA's runtime routes, in lora_modules.py, their opt-in)
    source = (ROOT / "nanoref" / "serving" / "api_server.py").read_text()
    routes = set(re.findall(r"@app\.(?:get|post|api_route)\(\"([^\"]+)\"", source)) - {"/reset_prefix_cache"}
    assert "/v1/completions" in routes, "no route found: the pattern no longer matches how the server declares them"
    description = parser_of("nanoref.serve").description
    assert sorted(path for path in routes if not re.search(rf"{re.escape(path)}(?![\w/])", description)) == []


# -- LLM's settings -------------------------------------------------------------------------------------------------
def documented_signature() -> dict[str, object]:
    """usage.md's `LLM(model, *, name=default, ...)` as {name: default}."""
    match = re.search(r"`LLM\(model, \*, (.*?)\)`: these are the fields", text("docs/usage.md"), re.S)
    assert match, "docs/usage.md no longer shows LLM's signature"
    call = ast.parse(f"f({' '.join(match[1].split())})", mode="eval").body
    return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}


def test_usage_md_shows_llms_signature_with_its_defaults():
    parameters = inspect.signature(LLM).parameters
    actual = {name: p.default for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert documented_signature() == actual


def test_llms_docstring_describes_every_engine_setting():
    # help(LLM) shows the signature and this text: each setting is named in it with what it does
    settings = {f.name for f in fields(EngineConfig) if f.init and f.name != "model"}
    assert sorted(name for name in settings if not re.search(rf"\b{name}\b", LLM.__doc__)) == []


def test_usage_md_table_describes_every_engine_setting_and_no_other():
    table = re.search(r"\| argument \| meaning \|\n(.*?)\n\n", text("docs/usage.md"), re.S)[1]
    named = {name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    settings = {f.name for f in fields(EngineConfig) if f.init and f.name != "model"}
    assert named - settings == set(), "the table names settings LLM does not take"
    assert settings - named == set(), "the table leaves these settings out"


# -- SamplingParams -------------------------------------------------------------------------------------------------
def test_usage_md_shows_sampling_params_defaults():
    match = re.search(r"`SamplingParams\((temperature=.*?)\)`", text("docs/usage.md"), re.S)
    call = ast.parse(f"f({' '.join(match[1].split())})", mode="eval").body
    shown = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    defaults = {f.name: f.default for f in fields(SamplingParams) if f.default is not MISSING}
    assert {name: defaults[name] for name in shown} == shown


def test_every_sampling_params_field_is_documented():
    docs = text("README.md") + text("docs/usage.md") + text("docs/serving.md")
    missing = [f.name for f in fields(SamplingParams) if f"`{f.name}`" not in docs]
    assert missing == []


# -- the command lines ----------------------------------------------------------------------------------------------
PARSERS = {"nanoref": "nanoref.__main__", "nanoref.serve": "nanoref.serve"}


def parser_of(command: str):
    return __import__(PARSERS[command], fromlist=["build_parser"]).build_parser()


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_number_a_help_text_gives_as_default_is_the_flags_default(command):
    wrong = []
    for action in parser_of(command)._actions:
        stated = re.search(r"\(default:? (\d[\d.]*)\b", action.help or "")
        if not stated:
            continue
        default = action.default
        if default is None:  # left to the engine: EngineConfig's default
            default = next((f.default for f in fields(EngineConfig) if f.name == action.dest), None)
        if str(default) != stated[1]:
            wrong.append(f"{action.option_strings[0]}: help says {stated[1]}, the default is {default!r}")
    assert wrong == []


def test_the_commands_help_names_the_prompt_it_runs_without_one():
    parser = parser_of("nanoref")
    (prompt,) = parser.parse_args([]).prompts
    assert f'"{prompt}"' in re.sub(r"\s+", " ", parser.format_help())


def test_every_flag_the_docs_pass_to_python_m_nanoref_or_its_server_exists():
    unknown = []
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            for command, args in re.findall(r"-m (nanoref(?:\.serve)?)((?: +(?:[^ `|#;]+))*)", line):
                options = {o for a in parser_of(command)._actions for o in a.option_strings}
                unknown += [
                    f"{doc.name}: {command} {flag}"
                    for flag in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", args)
                    if flag not in options
                ]
    assert unknown == []


# -- the course plan ------------------------------------------------------------------------------------------------
def test_teaching_md_gives_each_exercise_its_notebooks_points():
    rows = re.findall(r"^\| `(\d\d_\w+)` \|(.*)$", text("docs/teaching.md"), re.M)
    assert {notebook for notebook, _ in rows} == {path.stem for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    for notebook, row in rows:
        exercises = row.split(" | ")[1]
        documented = {name: int(points) for name, points in re.findall(r"`(\w+)` \((\d+)", exercises)}
        cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
        graded = {
            cell["metadata"]["nbgrader"]["grade_id"].removeprefix("ex_").removesuffix("_test"): cell["metadata"][
                "nbgrader"
            ]["points"]
            for cell in cells
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade")
        }
        assert documented == graded, notebook


def test_teaching_md_says_what_every_exercise_asks_for():
    # the list after "What each exercise asks for": one bullet per exercise, led by its name (and signature)
    section = text("docs/teaching.md").split("What each exercise asks for", 1)[1].split("\n## ", 1)[0]
    graded = {
        cell["metadata"]["nbgrader"]["grade_id"].removeprefix("ex_").removesuffix("_test")
        for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")
        for cell in json.loads(path.read_text())["cells"]
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade")
    }
    assert graded, "no graded cell found: the pattern no longer matches the notebooks' grade ids"
    assert sorted(name for name in graded if not re.search(rf"^- [^\n]*`{name}[(`]", section, re.M)) == []


def test_readmes_notebook_table_lists_every_notebook_with_its_exercises():
    rows = dict(re.findall(r"^\| `(\d\d_\w+)` \|(.*)$", text("README.md"), re.M))
    assert set(rows) == {path.stem for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    for notebook, row in rows.items():
        documented = set(re.findall(r"`(\w+)`", row.split(" | ")[-1]))
        cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
        graded = {
            cell["metadata"]["nbgrader"]["grade_id"].removeprefix("ex_").removesuffix("_test")
            for cell in cells
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade")
        }
        assert documented == graded, notebook


# -- the Python examples --------------------------------------------------------------------------------------------
def runnable(block: str) -> bool:
    """Examples that need no server, event loop or adapter folders of the reader's own."""
    return not any(needs in block for needs in ("OpenAI(", "await ", "AsyncLLM(", "adapters/"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["README.md", "docs/usage.md", "docs/serving.md"])
def test_the_python_examples_run_on_the_built_in_model(name, capsys):
    blocks = [block for block in python_blocks(name) if runnable(block)]
    assert blocks
    if any("StructuredOutputsParams(" in block for block in blocks):
        pytest.importorskip("xgrammar", reason="the structured-output example needs xgrammar")
    namespace: dict = {}
    for block in blocks:  # one namespace per file: a later example uses an earlier one's `llm`
        code = block.replace('LLM("path/to/Qwen3-0.6B")', "LLM()")
        exec(compile(code, name, "exec"), namespace)
    if "trace" in namespace:  # README's and usage.md's trace: decode's q is (B, 1, heads, head_dim)
        config = namespace["llm"].config.hf_config
        q = namespace["trace"].steps[1].stage("layers.0.attn.decode")["q"]
        assert tuple(q) == (1, 1, config.num_attention_heads, config.head_dim)


@pytest.mark.slow
def test_lora_mds_example_runs_on_adapters_of_the_built_in_model_and_leaves_its_request_to_step(
    tmp_path, monkeypatch, capsys
):
    # its "adapters/sql" and "adapters/chat" made for the built-in model; the request it adds last, "then llm.step()
    # as usual", is still there for step() to run (a stream after it would have run it to its end)
    pytest.importorskip("peft", reason="the adapters are made with peft")
    from nanoref.llm import DEFAULT_MODEL
    from nanoref.testing import make_random_lora

    for seed, name in enumerate(["sql", "chat"]):
        make_random_lora(tmp_path / "adapters" / name, DEFAULT_MODEL, seed=seed)
    monkeypatch.chdir(tmp_path)
    (block,) = python_blocks("docs/lora.md")
    namespace: dict = {}
    exec(compile(block.replace('"path/to/Qwen3-0.6B"', repr(str(DEFAULT_MODEL))), "docs/lora.md", "exec"), namespace)
    llm, finished = namespace["llm"], []
    while not llm.is_finished():
        finished += llm.step()[0]
    assert [seq.token_ids[: seq.num_prompt_tokens] for seq in finished] == [llm.tokenizer.encode("SELECT")]


@pytest.mark.slow
def test_the_readmes_openai_client_example_runs_against_the_server(capsys):
    # README's quick start: `python -m nanoref.serve --device cpu`, then its openai block, here against the same
    # server on a free port (the block's base_url is 127.0.0.1:8000)
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from nanoref.serving.async_llm import AsyncLLM
    from tests.helpers import running_server

    (block,) = [block for block in python_blocks("README.md") if "OpenAI(" in block]
    assert 'base_url="http://127.0.0.1:8000/v1"' in block
    with running_server(AsyncLLM(LLM()), "nanoref/default_model") as server:
        namespace: dict = {}
        exec(compile(block.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), namespace)
    assert namespace["model"] == "nanoref/default_model"
    assert capsys.readouterr().out  # the streamed completion's text


CHECK_THROUGH_WITH_VENV = r"bash\s+(\S*)\.ci/with-venv\s+python\s+-m\s+nanoref\.classroom\s+check\s+(\S+)"


def test_a_notebook_checked_through_with_venv_is_named_from_the_repositorys_root():
    # .ci/with-venv runs its command from the repository's root, wherever it is called from: called as
    # `bash .ci/with-venv` the shell is in the repository's root too, so "$PWD/x" is the repository's x (a course's
    # student copy of a notebook is the notebook's); called by its path in the checkout, "$PWD/x" is the caller's
    from nanoref.classroom.build import HANDOUT

    wrong = []
    for name, doc in [*((doc.name, doc.read_text()) for doc in DOCS), ("the student handout", HANDOUT)]:
        for script, path in re.findall(CHECK_THROUGH_WITH_VENV, doc):
            path = path.rstrip(",.;)").strip("`\"'")
            if script:  # /path/to/nanoref/.ci/with-venv, from the learner's folder
                if not path.startswith("$PWD/"):
                    wrong.append(f"{name}: {path} (not a full path, from {script}.ci/with-venv)")
                continue
            in_repo = re.sub(r"^course/release/\w+/", "notebooks/", path.removeprefix("$PWD/"))
            if not (ROOT / in_repo).is_file():
                wrong.append(f"{name}: {path}")
    assert wrong == []


def test_no_doc_runs_nbgrader_through_with_venv():
    # nbgrader's commands read the course folder they run in; .ci/with-venv runs its command from the repository's root
    wrong = [
        f"{doc.name}: {line.strip()}"
        for doc in DOCS
        for line in doc.read_text().splitlines()
        if re.search(r"\.ci/with-venv\s+nbgrader\b", line)
    ]
    assert wrong == []


def test_the_sites_front_page_links_every_page_of_docs():
    linked = set(re.findall(r"\]\((\w+\.md)", text("docs/index.md")))
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert sorted(pages - linked) == []


def test_every_metric_the_docs_name_is_one_the_server_exports():
    # the names a dashboard queries: a counter's sample is NAME_total, a histogram's family NAME (NAME_bucket, ...)
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    import urllib.request

    from nanoref.serving.api_server import serve_in_background
    from nanoref.serving.async_llm import AsyncLLM
    from nanoref.serving.lora_modules import LoRAModules

    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=16, enable_lora=True))
    try:
        adapters = LoRAModules(engine.config, "m", {})
        with serve_in_background(engine, "m", lora_modules=adapters) as url:
            exposition = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    finally:
        engine.close()
    exported = set(re.findall(r"^# (?:HELP|TYPE) (\S+)", exposition, re.M))
    exported |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"^([^#\s{]+)", exposition, re.M)}
    named = {name for doc in DOCS for name in re.findall(r"`((?:nanoref_|vllm:)\w+)", doc.read_text())}
    assert named, "no metric found in the docs: the pattern no longer matches how they name them"
    assert sorted(named - exported) == []
