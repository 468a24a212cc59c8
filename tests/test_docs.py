"""The docs site (docs/, mkdocs.yml) and the front page (README.md): the site builds with
`mkdocs build --strict` (a broken link, a missing anchor or a page left out of the nav fails it),
every page is in the nav, the README stays a front page, and every relative link of the README and
the other guides (cluster/, the Helm chart) reaches a file, and its anchor a heading of the built
page.

Every fenced block of README.md and docs/*.md is one of three (test_every_block_is_run_mapped_or_says_why_not):
run here as written, read from the page (RUN: the examples on the default model, their placeholders
its folder), mapped to the tests that run its equivalent (MAPPED: a server, Ray, a test model), or
marked in the page itself, its first line `# not run in the tests: REASON` (a cluster, an index).
Every `raymuter` and `make` line of a block is one the command takes, every curl body one its route
takes, and the defaults the pages state as values are the code's (CLAIMS)."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
GUIDES = [ROOT / "README.md", ROOT / "cluster" / "README.md", ROOT / "helm" / "raymuter" / "README.md"]
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_built_and_in_the_nav(site):
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages
    assert len(pages) >= 6  # the index and at least five task pages
    for page in pages:
        built = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        assert built.is_file(), page


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for heading in ("## The two commands", "## Install", "## Quick start", "## Supported models", "## Documentation"):
        assert heading in readme
    assert "make serve" in readme and "make test" in readme


def anchors_of(html: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html.read_text()))


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_a_guide_resolves(site, guide):
    targets = [t for t in LINK.findall(guide.read_text()) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (guide.parent / path).resolve() if path else guide
        assert file.exists(), f"{guide.relative_to(ROOT)}: {target}"
        if anchor and file.parent == DOCS:
            built = site / ("index.html" if file.name == "index.md" else file.stem + "/index.html")
            assert anchor in anchors_of(built), f"{guide.relative_to(ROOT)}: {target}"


def test_the_site_s_links_are_checked_by_the_build(tmp_path):
    """The strict build is what holds the pages' own links: a page with a broken one fails it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no anchor](#nowhere)\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"), nav=[{"Home": "index.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "nowhere" in done.stderr


# -- every fenced block: run here (RUN), run elsewhere (MAPPED), or marked in the page --------------
MARKER = re.compile(r"#[ \t]*not run in the tests:[ \t]*\S")
FENCE = re.compile(r"^( *)(`{3,}|~{3,})\s*([\w+-]*)")
PLACEHOLDERS = {"folder-or-hub-id", "path/to/folder", "org/name"}  # the default model's folder, where run


@dataclass(frozen=True)
class Block:
    page: str  # relative to the root: README.md, docs/python.md
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def marked(self) -> bool:
        """The page says why it does not run: its first line is `# not run in the tests: REASON`."""
        return bool(MARKER.match(self.code.strip().split("\n", 1)[0]))

    @property
    def key(self) -> str:
        """`page: first line` (its first line past the marker, without a trailing comment)."""
        lines = [line for line in self.code.splitlines() if line.strip() and not MARKER.match(line.strip())]
        first = re.sub(r"\s+#.*$", "", lines[0].strip()) if lines else ""
        return f"{self.page}: {first}"


def fenced_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order (an indented fence's indent taken off its lines)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, mark, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(mark)), len(lines))
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        blocks.append(Block(page, i + 1, lang, code + "\n"))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def unaccounted(blocks: list[Block], run: dict, mapped: dict) -> list[str]:
    """The blocks neither run, nor mapped, nor marked: `key (line N)` each."""
    return [f"{b.key} (line {b.line})" for b in blocks if b.key not in run and b.key not in mapped and not b.marked]


# Run by this module, as the page writes them: key -> the test that runs it.
RUN = {
    "README.md: import generation": "test_the_engine_examples_run_on_the_default_model",
    "docs/python.md: import generation": "test_the_engine_examples_run_on_the_default_model",
    'docs/python.md: raymuter generate "The list type"': "test_the_generate_commands_run_on_the_default_model",
    "docs/python.md: state = generation.new_state(ctx, slots=8, capacity=2048)":
        "test_the_decode_state_example_runs_on_the_default_model",
    'docs/settings.md: ctx = generation.context(model, max_new_tokens=64, structured_outputs={"json": {':
        "test_the_structured_outputs_example_validates_on_the_default_model",
}
SERVE_CLI = "tests/deployments/cli/test_serve_cli.py::"
APP = "tests/deployments/app/test_serve.py::"
PACKAGING = "tests/test_packaging.py::"
QUICK_START = (PACKAGING + "test_a_batch_through_raymuter_serve_runs_from_the_serve_install",  # the serve install
               SERVE_CLI + "test_the_default_layout_frees_slots_left_whole_and_answers_503_while_its_engine_restarts",
               APP + "test_the_openai_client_works_unchanged",  # a streamed chat; its body: test_each_curl_body_...
               "tests/test_docs.py::test_each_curl_body_is_one_its_route_takes")
# Run elsewhere (a server, Ray, a test model that takes minutes to build): key -> the tests that run its equivalent.
MAPPED = {
    "README.md: pip install -c constraints.txt --build-constraint constraints.txt '.[cpu]'": (
        PACKAGING + "test_every_file_of_the_packages_is_installed_and_nothing_else",
        PACKAGING + "test_raymuter_generate_runs_the_installed_default_model"),
    "README.md: pip install 'raymuter[cpu,serve]'": QUICK_START,
    "docs/index.md: pip install 'raymuter[cpu,serve]'": QUICK_START,
    "README.md: from openai import OpenAI": (APP + "test_the_openai_client_works_unchanged",),
    "docs/batch.md: raymuter batch requests.jsonl answers.jsonl --model path/to/folder --replicas 2 --slots 32": (
        PACKAGING + "test_raymuter_batch_runs_from_the_serve_install",
        "tests/deployments/batch/test_batch_cli.py::test_a_csv_table_runs_its_column_as_completions"),
    "docs/batch.md: import time": (
        "tests/deployments/app/test_serve_batches.py::test_each_output_line_is_the_same_request_sent_directly",),
    "docs/cluster.md: import ray": (APP + "test_python_handles_typed_and_streaming",),
    "docs/lora.md: import generation": (
        "tests/generation/engine/test_lora_rows.py::test_a_mixed_batch_gives_each_row_peft_alone",),
    "docs/models.md: from generation.tasks import image_text_to_text": (
        "tests/generation/families/test_vision.py::test_more_rows_than_slots",
        "tests/deployments/app/test_serve_vision.py::test_chat_with_images_equals_image_text_to_text"),
    "docs/serving.md: raymuter serve": (
        SERVE_CLI + "test_the_default_layout_frees_slots_left_whole_and_answers_503_while_its_engine_restarts",
        "tests/deployments/services/test_decoder_service.py::test_no_spin_reaches_the_decoders_session",
        "tests/generation/front/test_engine_process.py::test_the_cli_places_the_engine_process_and_names_its_flags",
        APP + "test_the_openai_client_works_unchanged"),
    "docs/serving.md: from ray import serve": (
        APP + "test_python_handles_typed_and_streaming",
        "tests/deployments/app/test_serve_embeddings.py::test_the_handle_api"),
}


def test_every_block_is_run_mapped_or_says_why_not():
    blocks = all_blocks()
    keys = [b.key for b in blocks]
    assert len(blocks) >= 20 and len(keys) == len(set(keys)), "two blocks share a key: `page: first line`"
    assert unaccounted(blocks, RUN, MAPPED) == []
    assert not set(RUN) & set(MAPPED)
    assert not (set(RUN) | set(MAPPED)) - set(keys), "an entry names a block no page has (edited? moved?)"
    assert not [b.key for b in blocks if b.marked and b.key in set(RUN) | set(MAPPED)], "marked, yet listed"
    for name in set(RUN.values()):
        assert name.startswith("test_") and callable(globals().get(name)), name


def test_the_classifier_reports_an_unmarked_block():
    """A synthetic page: a listed block, a marked one, and three that are neither (a marker with
    no reason, or one in an HTML comment before the block, is none)."""
    page = ("# Page\n\n```sh\nraymuter generate x   # run\n```\n\n"
            "```sh\n# not run in the tests: needs a cluster\nhelm install x\n```\n\n"
            "  ```python\n  import nothing\n  ```\n\n"
            "```sh\n# not run in the tests:\nray start\n```\n\n"
            "<!-- not run in the tests: hidden -->\n~~~yaml\nkey: value\n~~~\n")
    blocks = fenced_blocks(page, "p.md")
    assert [(b.line, b.lang, b.key) for b in blocks] == [
        (3, "sh", "p.md: raymuter generate x"), (7, "sh", "p.md: helm install x"),
        (12, "python", "p.md: import nothing"), (16, "sh", "p.md: # not run in the tests:"),
        (22, "yaml", "p.md: key: value")]
    assert unaccounted(blocks, {"p.md: raymuter generate x": "test_x"}, {}) == [
        "p.md: import nothing (line 12)", "p.md: # not run in the tests: (line 16)", "p.md: key: value (line 22)"]


def test_each_mapped_block_names_tests_that_exist():
    for key, tests in MAPPED.items():
        assert tests, key
        for test in tests:
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{key}: {test} is no test"


def blocks_run_by(test: str) -> list[Block]:
    found = [b for b in all_blocks() if RUN.get(b.key) == test]
    assert found, f"no block of the pages is run by {test}"
    return found


def shell_commands(code: str) -> list[list[str]]:
    """Each command line of a shell block (continuations joined, comments dropped), split as sh does."""
    return [words for line in code.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


@pytest.fixture(scope="module")
def default_model() -> str:
    from generation.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def loaded(default_model):
    """The default model and its tokenizer, loaded once."""
    import generation
    from generation.text.tokenizer import load_tokenizer

    model = generation.load(default_model)
    return model, load_tokenizer(model.tokenizer_path, model.folder)


def run_example(block: Block, folder: str | None = None, **scope) -> dict:
    """The block's code, as written (its placeholders `folder`, if given), run in `scope`."""
    code = block.code
    for placeholder in PLACEHOLDERS if folder else ():
        code = code.replace(f'"{placeholder}"', repr(folder))
    scope = {"__name__": "docs_example", **scope}
    exec(compile(code, f"{block.page}:{block.line}", "exec"), scope)  # noqa: S102 - our own pages
    return scope


def test_the_engine_examples_run_on_the_default_model(default_model):
    """The README's quick start and the engine page's example, as written, with the default
    model's folder for their placeholder: the same rows, an empty prompt's empty."""
    rows = {}
    for block in blocks_run_by("test_the_engine_examples_run_on_the_default_model"):
        assert '"folder-or-hub-id"' in block.code, block.key
        rows[block.page] = run_example(block, default_model)["rows"]
    assert set(rows) == {"README.md", "docs/python.md"}
    first = rows["README.md"]
    assert len(first) == 3 and first[2] == [] and all(0 < len(r) <= 32 for r in first[:2])
    assert rows["docs/python.md"] == first


def test_the_generate_commands_run_on_the_default_model(default_model):
    """Each `raymuter generate` line of the engine page, its folder or hub id the default model's:
    each prompt's text printed (several under `--- PROMPT`), at most --max-new-tokens each."""
    from deployments.cli import parser

    (block,) = blocks_run_by("test_the_generate_commands_run_on_the_default_model")
    config = json.loads((Path(default_model) / "generation_config.json").read_text())
    commands = shell_commands(block.code)
    assert len(commands) >= 3
    for words in commands:
        assert words[:2] == ["raymuter", "generate"], words
        argv = [default_model if w in PLACEHOLDERS else w for w in words[1:]]
        args = parser().parse_args(argv)
        done = subprocess.run([sys.executable, "-m", "deployments.cli", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        (count,) = map(int, re.findall(r"\[raymuter\] (\d+) tokens in", done.stderr))
        assert 0 < count <= (args.max_new_tokens or config["max_new_tokens"]) * len(args.prompts), done.stderr
        assert ("no --model given: using the default model" in done.stderr) == (args.model is None)
        if len(args.prompts) == 1:
            assert done.stdout.strip(), words
        else:
            heads = [line[4:] for line in done.stdout.splitlines() if line.startswith("--- ")]
            assert heads == args.prompts, done.stdout


def test_the_decode_state_example_runs_on_the_default_model(loaded):
    """The decode state's verbs as the page lists them (`ctx`, `prompt`, `slot` and `other` given):
    the same prompt and seed in two slots give the same tokens, and a released slot is free again."""
    import generation

    model, tokenizer = loaded
    (block,) = blocks_run_by("test_the_decode_state_example_runs_on_the_default_model")
    ctx = generation.compile(generation.context(model, max_new_tokens=32, do_sample=False), batch_size=4)
    prompt = tokenizer.encode("The list type").ids
    scope = run_example(block, generation=generation, ctx=ctx, prompt=prompt, slot=0, other=1)
    assert int(scope["first"].token[0]) == int(scope["prefix"].first.token[0])
    out = scope["out"].token
    assert out[0] == out[1] >= 0 and (out[2:] == -1).all(), out
    state = scope["state"]
    generation.admit(ctx, state, [0], [prompt], seeds=[0])  # released: free
    with pytest.raises(ValueError, match="not a free slot"):
        generation.admit(ctx, state, [1], [prompt], seeds=[0])  # still live


def test_the_structured_outputs_example_validates_on_the_default_model(loaded):
    """Settings' structured outputs example (`generation`, `model` and `prompts` given): every row
    that ended before max_new_tokens parses and validates against the schema; some do."""
    import jsonschema

    import generation

    model, tokenizer = loaded
    (block,) = blocks_run_by("test_the_structured_outputs_example_validates_on_the_default_model")
    prompts = [tokenizer.encode(text).ids for text in ("The list type", "A person:", "{")]
    scope = run_example(block, generation=generation, model=model, prompts=prompts)
    (constraint,) = [ast.literal_eval(k.value) for node in ast.walk(ast.parse(block.code)) if isinstance(node, ast.Call)
                     for k in node.keywords if k.arg == "structured_outputs"]  # the schema as the page writes it
    schema = constraint["json"]
    finished = [row for row in scope["rows"] if len(row) < scope["ctx"].settings.max_new_tokens]
    assert finished, scope["rows"]
    for row in finished:
        jsonschema.validate(json.loads(tokenizer.decode(row, skip_special_tokens=True)), schema)


def test_every_python_block_compiles():
    for block in all_blocks():
        if block.lang == "python":
            compile(block.code, f"{block.page}:{block.line}", "exec")


def test_every_raymuter_and_make_line_is_one_the_command_takes():
    """Run or not, each `raymuter` line of a block parses with the command's own parser (a flag
    renamed or gone fails here), and each `make` line names targets and variables of the Makefile."""
    from deployments.cli import parser

    makefile = (ROOT / "Makefile").read_text()
    seen = set()
    for block in all_blocks():
        if block.lang not in ("sh", "bash", "console", ""):
            continue
        for words in shell_commands(block.code):
            where = f"{block.page}:{block.line}: {' '.join(words)}"
            if words[0] == "raymuter":
                try:
                    parser().parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"raymuter refuses {where}")
            elif words[0] == "make":
                for word in words[1:]:
                    name, eq, _ = word.partition("=")
                    defined = rf"^{re.escape(name)}\s*\?=" if eq else rf"^{re.escape(name)}:"  # a variable, a target
                    assert re.search(defined, makefile, re.M), where
            else:
                continue
            seen.add(words[0])
    assert seen == {"raymuter", "make"}


def test_each_curl_body_is_one_its_route_takes():
    """Each curl line's body validates into its route's request shape, and names the default
    model as the server calls it where the block serves the default model."""
    from deployments.config import DEFAULT_MODEL_NAME
    from deployments.http.openai import ChatCompletionRequest, CompletionRequest

    shapes = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
    found = 0
    for block in all_blocks():
        commands = shell_commands(block.code)
        default = any(words[:2] == ["raymuter", "serve"] and "--model" not in words for words in commands)
        for words in commands:
            if words[0] != "curl":
                continue
            (url,) = [w for w in words[1:] if "/v1/" in w]
            body = json.loads(words[words.index("-d") + 1])
            route = "/v1/" + url.split("/v1/", 1)[1]
            assert route in shapes, f"{block.page}:{block.line}: no shape here for {route}"
            shapes[route].model_validate(body)
            if default:
                assert body["model"] == DEFAULT_MODEL_NAME, f"{block.page}:{block.line}"
            found += 1
    assert found >= 3  # the README's, the index's and serving's quick starts


# -- the defaults the pages state, as values, against the code ----------------------------------
def code_value(where: str):
    """`serve NAME` (`raymuter serve`'s argparse default), `AppConfig NAME`, `path/to/module.py NAME`
    (a literal read without importing it: deployments/app.py imports Ray) or `module NAME`; NAME[i]
    an item of it."""
    import importlib

    from deployments.cli import parser
    from deployments.config import AppConfig

    source, _, name = where.partition(" ")
    name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", name).groups()
    if source == "serve":
        value = getattr(parser().parse_args(["serve"]), name)
    elif source == "AppConfig":
        value = getattr(AppConfig(), name)
    elif source.endswith(".py"):
        (value,) = [ast.literal_eval(node.value) for node in ast.parse((ROOT / source).read_text()).body
                    if isinstance(node, ast.Assign)
                    and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]]
    else:
        value = getattr(importlib.import_module(source), name)
    return value if index is None else value[int(index)]


def quantity(text: str) -> float | str:
    """A value as a page writes it: 600, 1.5, 256 MiB, 300 s, 30 days; an address as it is."""
    number, _, unit = text.partition(" ")
    if number.count(".") > 1:
        return text
    return float(number) * {"": 1, "s": 1, "MiB": 2**20, "days": 86400}[unit]


# (page, its sentence stating a default, the value in the group; where the code keeps it)
CLAIMS = [
    ("docs/serving.md", r"`--start-timeout` seconds \((\d+)\)", "serve start_timeout"),
    ("docs/serving.md", r"with a loopback `--host` \(the default, ([\d.]+)\)", "serve host"),
    ("docs/serving.md", r"`--max-logprobs`, (\d+) by default", "serve max_logprobs"),
    ("docs/serving.md", r"`--response-store-bytes`, (\d+ MiB)", "serve response_store_bytes"),
    ("docs/serving.md", r"`raymuter serve --prefix-cache-bytes`, (\d+ MiB) by", "serve prefix_cache_bytes"),
    ("docs/models.md", r"--prefix-cache-bytes`, (\d+ MiB) per decoder replica by default",
     "serve prefix_cache_bytes"),
    ("docs/batch.md", r"`--file-size-limit` bytes \((\d+ MiB)", "serve file_size_limit"),
    ("docs/performance.md", r"`--slots (\d+)`, the server's default", "serve slots"),
    ("docs/python.md", r"serve --prefill-chunk-tokens N`: (\d+) by default",
     "generation.engine.batching DEFAULT_PREFILL_CHUNK_TOKENS"),
    ("docs/serving.md", r"`DRAIN_SECONDS` \((\d+ s);", "deployments/app.py DRAIN_SECONDS"),
    ("docs/cluster.md", r"for up to (\d+ s) \(`DRAIN_SECONDS`\)", "deployments/app.py DRAIN_SECONDS"),
    ("docs/serving.md", r"`stream_interval_ms` \((\d+) ms", "AppConfig stream_interval_ms"),
    ("docs/serving.md", r"argument `max_body_bytes` \((\d+ MiB)\)", "AppConfig max_body_bytes"),
    ("docs/cluster.md", r"\(`max_body_bytes`, (\d+ MiB)\)", "AppConfig max_body_bytes"),
    ("docs/serving.md", r"streams together send about (\d+) a second",
     "deployments.services.generator CHUNKS_PER_SECOND"),
    ("docs/settings.md", r"more than ([\d.]+)x a plain one \(`MAX_STEP_SLOWDOWN`",
     "generation.params.limits MAX_STEP_SLOWDOWN"),
    ("docs/models.md", r"(\d+) frames per video \(`generation.params.limits.MAX_VIDEO_FRAMES`",
     "generation.params.limits MAX_VIDEO_FRAMES"),
    ("docs/models.md", r"(\d+ MiB) of RGB frames per video \(`videos.MAX_VIDEO_BYTES`",
     "generation.families.videos MAX_VIDEO_BYTES"),
    ("docs/batch.md", r"\) (\d+ days) after it was made, OpenAI's default",
     "deployments.services.files EXPIRES_AFTER[1]"),
]


@pytest.mark.parametrize("page, sentence, where", CLAIMS, ids=[f"{c[0]}:{c[2]}" for c in CLAIMS])
def test_a_stated_default_is_the_code_s(page, sentence, where):
    text = " ".join((ROOT / page).read_text().split())  # a sentence across lines
    found = re.findall(sentence, text)
    assert len(found) == 1, f"{page}: {sentence!r} is gone or repeated (edit CLAIMS with the page)"
    value = code_value(where)
    assert quantity(found[0]) == (value if isinstance(value, str) else float(value)), (page, found[0], where, value)


def test_the_routes_the_pages_open_without_the_key_are_the_code_s():
    """Serving's errors and `--api-key`'s help: every route but /health takes the key; in the code,
    the routes that depend on neither `guarded` nor `authorized`."""
    import argparse

    from fastapi.routing import APIRoute

    from deployments.cli.serve import add_arguments
    from deployments.http.routes import ROUTERS

    def calls(dependant) -> set[str]:
        return {getattr(d.call, "__name__", "") for d in dependant.dependencies} | {
            name for d in dependant.dependencies for name in calls(d)}

    open_routes = {route.path for router in ROUTERS for route in router.routes
                   if isinstance(route, APIRoute) and not calls(route.dependant) & {"guarded", "authorized"}}
    (stated,) = re.findall(r"401 without the API key \(on every route but `([^`]+)`:",
                           " ".join((DOCS / "serving.md").read_text().split()))
    assert open_routes == {stated} == {"/health"}
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    assert f"every route but {stated} requires" in " ".join(serve.format_help().split())
