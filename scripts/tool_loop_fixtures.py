#!/usr/bin/env python3
"""Native tool loops in the formats whose markers are special tokens (Mistral's `[TOOL_CALLS]`, gpt-oss's
harmony), as transformers renders them with the models' own chat templates, for
`holo-runtime/holo-core/tests/core/tool_loops.rs`.

Run in the peers' venv (transformers; torch is not needed), from the repository root:

    ~/.cache/holo-peers/venv/bin/python scripts/tool_loop_fixtures.py --templates DIR

where DIR holds llama.cpp's copies of the templates (`vendor/llama.cpp/models/templates/` of the PyPI sdist
`llama-cpp-python==0.3.36`: `pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36`,
then untar it); without `--templates` the folders already committed are reused.

It writes, under `holo-runtime/tests/fixtures/chat/tool_models/`, one model folder per template: the real chat
template (Mistral Nemo's and Mistral Small 3.2's in `tokenizer_config.json`, gpt-oss's in `chat_template.jinja`, as the models ship
them), the family's markers as special tokens (`added_tokens_decoder`, as the models mark them), and a
`tokenizer.json`: the Holophore fixtures' byte-level BPE (`tests/fixtures/holophore/tokenizer.json`) with those
special tokens added. Then `tool_loops.json` beside them: per case, the holoware's conversation turn by turn
(the reply each turn as the model writes it, special tokens included), and for every sample request the prompt
transformers renders (`apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)`) with its ids
(that tokenizer, no added tokens), whether it extends the previous prompt and reply (the context grows) or not
(the context is split), and the final messages as OpenAI's chat format holds them (calls with their ids, tool
messages with `tool_call_id`; the Rust test compares the records with them).

Ids: a call's id is the one the model wrote when it is nine letters and digits, else the one
`holotypes/tools/native.rs` draws (`call_id`, reproduced below). Results are the calculator's and the tool
loop's error messages, as `ToolExecutor` writes them. `strftime_now` (gpt-oss's template prints the date) is
frozen at `NOW`.
"""

import argparse
import json
import shutil
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "holo-runtime/tests/fixtures"
FOLDERS = FIXTURES / "chat/tool_models"
OUT = FOLDERS / "tool_loops.json"
BPE = FIXTURES / "holophore/tokenizer.json"
NOW = datetime(2025, 3, 7, 9, 5, 3)

# The calculator as `Tools::native_schemas` offers it.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

# folder: (template file in llama.cpp's folder, where the model ships it, special tokens, bos, eos)
MODELS = {
    "mistral-nemo": (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "tokenizer_config.json",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"],
        "<s>",
        "</s>",
    ),
    "mistral-small": (
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        "tokenizer_config.json",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
         "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"],
        "<s>",
        "</s>",
    ),
    "gpt-oss": (
        "openai-gpt-oss-120b.jinja",
        "chat_template.jinja",
        ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
         "<|end|>", "<|message|>", "<|call|>"],
        "<|startoftext|>",
        "<|return|>",
    ),
}

QUESTION = "What is 17 * 23?"
# The answer as the record keeps it: the sampler's text (its tokens without their special tokens), or
# harmony's final message, with its analysis as `thinking`.
ANSWER = {"answer": "The product is <answer>391</answer>."}
SYSTEM = "Use the tools when they help. Give the final answer inside <answer> tags."


def call_id(number: int, name: str) -> str:
    """`holotypes/tools/native.rs`'s `call_id` for the rollout's call `number` (from 1)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    value = 0xCBF29CE484222325
    for byte in number.to_bytes(8, "little") + name.encode():
        value = ((value ^ byte) * 0x100000001B3) % (1 << 64)
    out = ""
    for _ in range(9):
        out += digits[value % 62]
        value //= 62
    return out


# Per case: the model folder, the system message (none: the holoware has none), and the turns: the reply as
# the model writes it, and what the tool loop makes of it: the calling turn's message (`None`: the answer)
# and the results, one per call. A call's `id` of `None` is drawn by `call_id`.
def cases():
    nemo_list = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "17 * 23"}, "id": "a1b2c3d4e"}]</s>'
    nemo_malformed = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "17 * 23"}</s>'
    nemo_two = (
        '[TOOL_CALLS][{"name": "search", "arguments": {"query": "17 * 23"}}, '
        '{"name": "calculator", "arguments": {"expression": "391 / 23"}}]</s>'
    )
    mistral = {
        "model": "mistral-nemo",
        "system": None,
        "turns": [
            (nemo_list, {"content": "", "calls": [("calculator", {"expression": "17 * 23"}, "a1b2c3d4e")]}, ["391"]),
            (
                nemo_malformed,
                {
                    "content": "",
                    "calls": [("mistral", '[{"name": "calculator", "arguments": {"expression": "17 * 23"}', None)],
                },
                ["error: the tool call is not valid JSON: EOF while parsing an object at line 1 column 62"],
            ),
            (
                nemo_two,
                {
                    "content": "",
                    "calls": [("search", {"query": "17 * 23"}, None), ("calculator", {"expression": "391 / 23"}, None)],
                },
                ["error: unknown tool `search`; the tools are: calculator", "17"],
            ),
            ("The product is <answer>391</answer>.</s>", ANSWER, []),
        ],
    }
    # Mistral Small 3.2 (v11 tokenizers: a call per `[TOOL_CALLS]`, its arguments after `[ARGS]`): a call
    # without the `[CALL_ID]` its template writes in history, one with it, a malformed one, the answer.
    small = {
        "model": "mistral-small",
        "system": SYSTEM,
        "turns": [
            (
                '[TOOL_CALLS]calculator[ARGS]{"expression": "17 * 23"}</s>',
                {"content": "", "calls": [("calculator", {"expression": "17 * 23"}, None)]},
                ["391"],
            ),
            (
                '[TOOL_CALLS]calculator[CALL_ID]b2c3d4e5f[ARGS]{"expression": "391 / 23"}</s>',
                {"content": "", "calls": [("calculator", {"expression": "391 / 23"}, "b2c3d4e5f")]},
                ["17"],
            ),
            (
                '[TOOL_CALLS]calculator[ARGS]{"expression": </s>',
                {"content": "", "calls": [("calculator", '{"expression":', None)]},
                ["error: the tool call is not valid JSON: EOF while parsing a value at line 1 column 14"],
            ),
            ("The product is <answer>391</answer>.</s>", ANSWER, []),
        ],
    }
    # gpt-oss: the first call written as the template renders calls (recipient before the channel), the
    # others as gpt-oss writes them (recipient after the channel, `<|constrain|>json`).
    oss_rendered = (
        "<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.calculator"
        '<|channel|>commentary json<|message|>{"expression": "17 * 23"}<|call|>'
    )
    oss_written = (
        "<|channel|>analysis<|message|>Check it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.calculator <|constrain|>json<|message|>{"expression":"391 / 23"}<|call|>'
    )
    oss_malformed = (
        "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
        '{"expression": 391 /<|call|>'
    )
    oss_unknown = '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query":"391"}<|call|>'
    oss_answer = (
        "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The product is <answer>391</answer>.<|return|>"
    )
    harmony = {
        "model": "gpt-oss",
        "system": SYSTEM,
        "turns": [
            (
                oss_rendered,
                {"content": "", "thinking": "Multiply.", "calls": [("calculator", {"expression": "17 * 23"}, None)]},
                ["391"],
            ),
            (
                oss_written,
                {"content": "", "thinking": "Check it.", "calls": [("calculator", {"expression": "391 / 23"}, None)]},
                ["17"],
            ),
            (
                oss_malformed,
                {"content": "", "calls": [("calculator", '{"expression": 391 /', None)]},
                [
                    "error: the arguments of the call of `calculator` are not valid JSON: "
                    "expected `,` or `}` at line 1 column 20"
                ],
            ),
            (
                oss_unknown,
                {"content": "", "calls": [("search", {"query": "391"}, None)]},
                ["error: unknown tool `search`; the tools are: calculator"],
            ),
            (oss_answer, dict(ANSWER, thinking="Done."), []),
        ],
    }
    return {"mistral": mistral, "mistral_v11": small, "harmony": harmony}


def make_folders(templates: Path | None) -> None:
    from tokenizers import AddedToken, Tokenizer

    for name, (source, shipped, special, bos, eos) in MODELS.items():
        folder = FOLDERS / name
        folder.mkdir(parents=True, exist_ok=True)
        if templates is not None:
            template = (templates / source).read_text(encoding="utf-8")
        elif shipped == "chat_template.jinja":
            template = (folder / shipped).read_text(encoding="utf-8")
        else:
            template = json.loads((folder / shipped).read_text(encoding="utf-8"))["chat_template"]
        tokenizer = Tokenizer.from_file(str(BPE))
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
        tokenizer.save(str(folder / "tokenizer.json"))
        config = {
            "added_tokens_decoder": {
                str(tokenizer.token_to_id(token)): {
                    "content": token,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for token in special
            },
            "bos_token": bos,
            "clean_up_tokenization_spaces": False,
            "eos_token": eos,
            "model_max_length": 4096,
            "tokenizer_class": "TokenizersBackend",
        }
        if shipped == "chat_template.jinja":
            (folder / shipped).write_text(template, encoding="utf-8")
        else:
            config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def openai_messages(case):
    """The conversation turn by turn: the messages before each sample request, and all of them at the end."""
    messages = [] if case["system"] is None else [{"role": "system", "content": case["system"]}]
    messages.append({"role": "user", "content": QUESTION})
    before = []
    number = 0
    for reply, calling, results in case["turns"]:
        before.append([dict(message) for message in messages])
        if "answer" in calling:
            message = {"role": "assistant", "content": calling["answer"]}
            if "thinking" in calling:
                message["thinking"] = calling["thinking"]
            messages.append(message)
            continue
        calls = []
        for name, arguments, written in calling["calls"]:
            number += 1
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
            call["id"] = written if written is not None else call_id(number, name)
            calls.append(call)
        message = {"role": "assistant", "content": calling["content"], "tool_calls": calls}
        if "thinking" in calling:
            message["thinking"] = calling["thinking"]
        messages.append(message)
        for call, result in zip(calls, results):
            messages.append(
                {"role": "tool", "name": call["function"]["name"], "content": result, "tool_call_id": call["id"]}
            )
    return before, messages


def render(templates: Path | None) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import chat_template_utils

    class FrozenDatetime(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - same signature as datetime.now
            return NOW

    chat_template_utils.datetime = FrozenDatetime
    make_folders(templates)
    out = {"generated_by": "scripts/tool_loop_fixtures.py", "now": NOW.isoformat(), "tools": TOOLS, "cases": {}}
    for key, case in cases().items():
        tokenizer = AutoTokenizer.from_pretrained(str(FOLDERS / case["model"]))
        before, messages = openai_messages(case)
        prompts = []
        previous = None
        for (reply, _, _), conversation in zip(case["turns"], before):
            text = tokenizer.apply_chat_template(
                conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            grows = previous is not None and text.startswith(previous)
            prompts.append({"text": text, "ids": ids, "grows": grows})
            previous = text + reply
        out["cases"][key] = {
            "model": case["model"],
            "system": case["system"],
            "question": QUESTION,
            "replies": [reply for reply, _, _ in case["turns"]],
            "prompts": prompts,
            "messages": messages,
        }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--templates", type=Path, help="llama.cpp's models/templates folder")
    arguments = parser.parse_args()
    render(arguments.templates)
