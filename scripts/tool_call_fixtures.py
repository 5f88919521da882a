#!/usr/bin/env python3
"""Tool-call replies as the models' own chat templates write them, for the parsers of `holo-core/src/tools/`.

Run in the peers' venv (transformers; torch is not needed), from the repository root:

    ~/.cache/holo-peers/venv/bin/python scripts/tool_call_fixtures.py

For each chat-fixture model whose template renders tool calls (Qwen3, Qwen2.5, Llama 3.2), it renders a
conversation whose last assistant message carries `tool_calls` with transformers'
`apply_chat_template(..., tools=TOOLS, tokenize=False)`, cuts the assistant turn out of it (what the model
would have written: after the generation prompt, before the end-of-turn marker), and writes
`holo-runtime/tests/fixtures/chat/tool_calls.json`: per model the reply text and the calls it holds.
The Rust tests read each reply back with the model's parser and compare the calls.

Per model it also renders native tool loops (`conversations`): a system and a user message with TOOLS,
the model's reply with its calls (cut from a rendering, as above), one `tool` message per call, and a
final answer. Each case keeps the renderings a Holophore must reproduce: the first prompt, the prompt
after the tool results (the calling turn as history: its content is the text before the calls, as the
Holophore hands it), and the whole conversation. Qwen3 has two cases: with reasoning before the calls
(kept in history after the last user turn) and with an empty think block (dropped from history: the
rendering no longer extends what the model saw).
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_fixtures import MODELS, tiny_tokenizer_json  # noqa: E402

OUT = MODELS.parent / "tool_calls.json"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    },
]

CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris — “Île”", "unit": "celsius"}},
    {"name": "get_time", "arguments": {"zone": "Europe/Paris"}},
]

SYSTEM = "You are a helpful assistant."
RESULTS = ["18 degrees and sunny", "14:05"]
ANSWER = "It is 18 degrees and sunny in Paris, and 14:05."
# Llama 3.2's template prints today's date unless given one.
KWARGS = {"llama3.2": {"date_string": "26 Jul 2024"}}
# model folder: case name -> the text the model writes before its calls.
CONVERSATIONS = {
    "qwen3": {"thinking": "<think>\nI will look both up.\n</think>\n\n", "empty_thinking": "<think>\n\n</think>\n\n"},
    "qwen2.5": {"plain": ""},
    "llama3.2": {"plain": ""},
}

# model folder: (calls in one message, generation prompt's end, end-of-turn marker)
MODELS_WITH_TOOLS = {
    "qwen3": (2, "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen2.5": (2, "<|im_start|>assistant\n", "<|im_end|>"),
    # Llama 3.2's template refuses more than one call per message.
    "llama3.2": (1, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    question = [{"role": "user", "content": "Weather and time in Paris?"}]
    out = {"generated_by": "scripts/tool_call_fixtures.py", "transformers": transformers.__version__, "tools": TOOLS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (count, opening, end) in MODELS_WITH_TOOLS.items():
            folder = Path(tmp) / name
            shutil.copytree(MODELS / name, folder, ignore=shutil.ignore_patterns("*.md"))
            tiny_tokenizer_json(folder)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            calls = CALLS[:count]
            assistant = {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": call} for call in calls],
            }
            rendered = tokenizer.apply_chat_template(question + [assistant], tools=TOOLS, tokenize=False)
            start = rendered.rindex(opening) + len(opening)
            reply = rendered[start : rendered.index(end, start)]
            out[name] = {"reply": reply, "calls": calls}
            kwargs = KWARGS.get(name, {})
            start = [{"role": "system", "content": SYSTEM}] + question
            cases = {}
            for case, before in CONVERSATIONS[name].items():
                calling = {
                    "role": "assistant",
                    "content": before,
                    "tool_calls": [{"type": "function", "function": call} for call in calls],
                }

                def render(messages, generation):
                    return tokenizer.apply_chat_template(
                        messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation, **kwargs
                    )

                rendered = render(start + [calling], False)
                cut = rendered.rindex(opening) + len(opening)
                written = rendered[cut : rendered.index(end, cut)]
                results = [
                    {"role": "tool", "name": call["name"], "content": result} for call, result in zip(calls, RESULTS)
                ]
                history = start + [calling] + results
                whole = render(history + [{"role": "assistant", "content": ANSWER}], False)
                cut = whole.rindex(opening) + len(opening)
                cases[case] = {
                    "kwargs": kwargs,
                    "reply": written,
                    "results": RESULTS[:count],
                    # The answer as the model writes it (Qwen3: after an empty think block).
                    "answer": whole[cut : whole.index(end, cut)],
                    "first_prompt": render(start, True),
                    "second_prompt": render(history, True),
                    "whole": whole,
                }
            out[name]["conversations"] = cases
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
