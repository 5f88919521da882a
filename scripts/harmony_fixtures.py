"""Writes holo-runtime/tests/fixtures/chat/harmony.json: gpt-oss replies in OpenAI's harmony format, as
openai-harmony (PyPI `openai-harmony`, the reference renderer and parser) renders and parses them, and how
vLLM's chat API reads them (`vllm/parser/harmony.py`: `--reasoning-parser openai_gptoss` with
`--tool-call-parser openai`).

    ~/.cache/holo-peers/venv/bin/python scripts/harmony_fixtures.py

Needs openai-harmony and tml-renderers (whose wheel holds o200k_base.tiktoken, the vocabulary harmony's
encoding is built from; harmony would otherwise download it); `scripts/prepare.sh peers` installs both.

Each case is a reply as the model writes it after its prompt's `<|start|>assistant`:
- `reply`: the reply's tokens decoded with their special tokens (harmony's `decode`);
- `messages`: the messages harmony's `StreamableParser` reads from those tokens (fed one at a time, then
  `process_eos`, as vLLM flushes it): role, channel, recipient, content_type, text;
- `expected`: what vLLM's chat answer holds: `reasoning` (the `analysis` messages), `content` (the
  `final` messages and preambles: `commentary` to no one), each non-empty text joined with newlines, or
  null; `tool_calls` (messages to `functions.NAME`: name and arguments, the arguments' JSON value, or
  null where vLLM passes on text that is not JSON).

Replies are rendered by harmony from messages where harmony can render them (it writes a call's recipient
before its channel: `<|start|>assistant to=functions.f<|channel|>commentary json<|message|>`); the forms
the model writes that harmony does not render (the recipient after the channel, a reply cut short) are
written as text and encoded by harmony's tokenizer.
"""

import json
import os
from importlib.metadata import version
from pathlib import Path

import tml_renderers

# Harmony's encoding reads its vocabulary from here instead of downloading it.
os.environ.setdefault(
    "TIKTOKEN_ENCODINGS_BASE", str(Path(tml_renderers.__file__).parent / "data")
)

from openai_harmony import (  # noqa: E402
    HarmonyEncodingName,
    HarmonyError,
    Message,
    Role,
    StreamableParser,
    load_harmony_encoding,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "holo-runtime/tests/fixtures/chat/harmony.json"

ENCODING = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
# The prompt's generation prompt, which the reply follows.
PROMPT = ENCODING.encode("<|start|>assistant", allowed_special="all")


def assistant(text, channel, recipient=None, content_type=None):
    message = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    if recipient is not None:
        message = message.with_recipient(recipient)
    if content_type is not None:
        message = message.with_content_type(content_type)
    return message


def rendered(messages, end):
    """The reply that writes `messages`, its last ended by `end` (`<|return|>`, `<|call|>`) as the
    model ends its turn (harmony renders a message with `<|end|>`, or `<|call|>` for a call)."""
    tokens = []
    for message in messages:
        tokens += ENCODING.render(message)
    if end == "<|return|>":
        assert tokens[-1] == ENCODING.encode("<|end|>", allowed_special="all")[0]
        tokens[-1] = ENCODING.encode(end, allowed_special="all")[0]
    assert tokens[: len(PROMPT)] == PROMPT, ENCODING.decode(tokens[:4])
    return tokens[len(PROMPT) :]


def written(text):
    return ENCODING.encode(text, allowed_special="all")


CASES = {
    "reasoning_then_answer": rendered(
        [assistant("The user greets. Answer briefly.", "analysis"), assistant("Hello! How can I help?", "final")],
        "<|return|>",
    ),
    "reasoning_then_call": rendered(
        [
            assistant("Need the weather: call get_weather.", "analysis"),
            assistant('{"city": "Paris", "unit": "celsius"}', "commentary", "functions.get_weather", "<|constrain|>json"),
        ],
        "<|call|>",
    ),
    # The form gpt-oss writes: the recipient after the channel.
    "call_after_the_channel": written(
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Tokyo"}<|call|>'
    ),
    "preamble_then_call": rendered(
        [
            assistant("Checking two cities.", "analysis"),
            assistant("Let me look that up.", "commentary"),
            assistant('{"city": "Oslo"}', "commentary", "functions.get_weather", "json"),
        ],
        "<|call|>",
    ),
    "two_analyses_then_answer": rendered(
        [assistant("First thought.", "analysis"), assistant("Second thought.", "analysis"), assistant("Done.", "final")],
        "<|return|>",
    ),
    "call_on_the_analysis_channel": written(
        '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"city":"Lima"}<|call|>'
    ),
    "browser_call_is_neither": written(
        '<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>commentary '
        'to=browser.search <|constrain|>json<|message|>{"query":"x"}<|call|>'
    ),
    "unicode": rendered(
        [assistant("Café → naïve 🙂", "analysis"), assistant("Ça va très bien 🎉", "final")],
        "<|return|>",
    ),
    "cut_inside_reasoning": written("<|channel|>analysis<|message|>Still thinking about"),
    "cut_inside_answer": written("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>The answer is"),
    "cut_inside_a_header": written("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin"),
    "answer_only": written("<|channel|>final<|message|>Just this.<|return|>"),
    "call_with_arguments_that_are_not_json": written(
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Paris}<|call|>"
    ),
}


def parsed(tokens):
    """The messages harmony's parser reads from `tokens`, as vLLM feeds them (then `process_eos`)."""
    parser = StreamableParser(ENCODING, role=Role.ASSISTANT)
    for token in tokens:
        parser.process(token)
    try:
        parser.process_eos()
    except HarmonyError:
        pass
    return parser.messages


def is_function(recipient):
    return recipient is not None and recipient.startswith("functions.")


def vllm_reading(messages):
    """vLLM's `HarmonyParser.parse` (with both parsers): reasoning, content and calls."""
    reasoning, content, calls = [], [], []
    for message in messages:
        if message.author.role != Role.ASSISTANT or not message.content:
            continue
        text = message.content[0].text
        if is_function(message.recipient):
            try:
                arguments = json.loads(text)
            except json.JSONDecodeError:
                arguments = None
            calls.append({"name": message.recipient.split("functions.", 1)[1], "arguments": arguments})
        elif message.channel == "analysis":
            if text:
                reasoning.append(text)
        elif message.channel == "final" or (message.channel == "commentary" and message.recipient is None):
            if text:
                content.append(text)
    return {
        "reasoning": "\n".join(reasoning) or None,
        "content": "\n".join(content) or None,
        "tool_calls": calls,
    }


def main():
    cases = []
    for name, tokens in CASES.items():
        messages = parsed(tokens)
        cases.append(
            {
                "name": name,
                "reply": ENCODING.decode(tokens),
                "messages": [
                    {
                        "role": str(message.author.role.value),
                        "channel": message.channel,
                        "recipient": message.recipient,
                        "content_type": message.content_type,
                        "text": message.content[0].text if message.content else "",
                    }
                    for message in messages
                ],
                "expected": vllm_reading(messages),
            }
        )
    fixture = {
        "generator": "scripts/harmony_fixtures.py",
        "versions": {"openai-harmony": version("openai-harmony")},
        "cases": cases,
    }
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
