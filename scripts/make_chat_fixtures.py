#!/usr/bin/env python3
"""Makes the chat-data fixtures under tests/fixtures/chat/ with `transformers` and `tokenizers`.

    pip install transformers tokenizers jinja2    # transformers 5.x (made with 5.24)
    python3 scripts/make_chat_fixtures.py

Writes two tokenizer directories, each a `tokenizer.json` and a `tokenizer_config.json` with a
chat template that marks the assistant's part with `{% generation %}...{% endgeneration %}`:

* `llama3/`: the GPT-2-style fixture tokenizer (tests/fixtures/tokens/tokenizer.json) with the
  Llama-3 control tokens added as special tokens and `<|begin_of_text|>` put first by its
  post-processor; a Llama-3-style template (`<|start_header_id|>role<|end_header_id|>\\n\\n`,
  content trimmed, `<|eot_id|>`), the generation block around the assistant's content and
  `<|eot_id|>`, `raise_exception` for an unknown role.
* `chatml/`: the Qwen2-style fixture tokenizer (tokens/tokenizer_qwen2.json, which already has
  `<|im_start|>` and `<|im_end|>`); a Qwen-style template in `chat_template.jinja` (block tags on
  lines of their own, so `trim_blocks` and `lstrip_blocks` matter; a default system prompt;
  `.split('</think>')` and `.lstrip()` on the assistant's content; the generation block around
  the content and `<|im_end|>`). Its `tokenizer_config.json` holds the same template *without*
  the generation markers: the `.jinja` file takes precedence (as in transformers), and the tests
  use the config's template for the fallback that finds the assistant's content by itself.

Then `expected.json`: for every conversation in `messages.jsonl`, per template, the rendered text,
`input_ids` and `assistant_masks` that
`tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)` returns; and for every line of `prompt_completion.jsonl` the
ids and trained mask of zerodp's prompt/completion rule (see `src/data/chat.rs`), computed here
with `tokenizers`: `encode(prompt + completion)` with the tokenizer's special tokens, a token
trained iff its span starts at or after the end of the prompt and is not empty, then the EOS
appended (trained) unless the ids already end with it (then that one is trained).
Last, `render_cases`: templates that exercise the Jinja features Hub templates lean on (macros,
`namespace`, loop variables, filters and tests, Python string and dict methods, `tojson`, the
`+` and `-` whitespace controls on generation tags), each rendered by transformers'
`render_jinja_template` with the generation blocks' ranges (converted to UTF-8 byte offsets).
The committed fixtures are what `cargo test --test it data::chat` reads, so the tests need no
Python.
"""

import json
import pathlib
import shutil

from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENS = ROOT / "tests" / "fixtures" / "tokens"
OUT = ROOT / "tests" / "fixtures" / "chat"

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- generation %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "        {%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Block tags on lines of their own: trim_blocks drops the newline after each, lstrip_blocks the
# indentation before it, so the text lines render as written.
CHATML_TEMPLATE = """{% if messages[0].role != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'assistant' %}
        {% set content = message.content %}
        {% if '</think>' in content %}
            {% set content = content.split('</think>')[-1].lstrip('\\n') %}
        {% endif %}
<|im_start|>assistant
{% generation %}
{{ content }}<|im_end|>
{% endgeneration %}
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
    {% if loop.last and message.role != 'assistant' %}
        {% break %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def without_generation(template):
    """The same template with its generation tags removed (the tags render nothing themselves)."""
    return template.replace("{% generation %}\n", "").replace("{% endgeneration %}\n", "")


CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What does ZeRO stage 3 shard?"},
        {"role": "assistant", "content": "The parameters, the gradients and the optimizer states."},
    ],
    [
        {"role": "user", "content": "Name a fox."},
        {"role": "assistant", "content": "The quick brown fox."},
        {"role": "user", "content": "And a dog?"},
        {"role": "assistant", "content": "The lazy dog."},
    ],
    [
        {"role": "user", "content": "Über naïve café — 日本語?"},
        {"role": "assistant", "content": "日本語のテキスト 🙂, ünïcödé wörds."},
    ],
    [
        {"role": "system", "content": "  Spaces around the system prompt.  "},
        {"role": "user", "content": "Reply with spaces around it."},
        {"role": "assistant", "content": "  \n Sure: tokens   with spaces.\t \n"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nthe data is sharded\n</think>\n\nIt is sharded."},
        {"role": "user", "content": "Thanks."},
    ],
]

# Jinja features as Hub templates use them; `{%+ generation %}` also keeps transformers from
# noticing the block (it looks for `{% generation %}`), which only costs a warning.
FEATURES_TEMPLATE = r"""{% macro head(role) -%}
<{{ role | upper }}>{% endmacro %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages[0:] if m.role != 'ignored' %}
{{ head(m.role) }} {{ loop.index }}/{{ loop.length }} {{ m.content is string }} {{ m is mapping }} {{ ns.last_user }}
  {% if m.role == 'assistant' %}
   {%+ generation %}
   {{ m.content.strip() }}|{{ m.content.split(' ') | length }}|{{ m.content.replace('a', 'A') }}
   {% endgeneration +%}
  {% else %}
{{ m.content | trim }} {{ m.get('name', 'anon') }} {{ m.content.startswith('Hi') }} {{ m.content.endswith('?') }}
  {% endif %}
{%- if loop.last %} last{% endif %}
{% endfor %}
{{ messages | map(attribute='role') | join(',') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ none }} {{ true }} {{ bos_token ~ eos_token }}
{%- for k, v in messages[0].items() %} {{ k }}={{ v }}{% endfor %}
{{ {"b": 1, "a": [1.5, "é\"x"]} | tojson }}
{{ messages[-1].content[:3] }} {{ (messages | length) // 2 }} {{ "%s-%d" | format("x", 3) }}
{% if add_generation_prompt %}<gen>{% endif %}
"""

TOOLS_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '[stdout]' + message['content'] | trim + '[/stdout]\n' }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<assistant>\n' }}
        {%- if message.get('tool_calls') is not none %}
            {%- set call = message['tool_calls'][0] %}
            {%- generation %}
                {{- '<function=' + call.function.name + '>' }}
                {{- call.function.arguments | tojson + '</function>' + eos_token }}
            {%- endgeneration %}
        {%- else %}
            {%- generation %}
                {{- message['content'] | trim + eos_token }}
            {%- endgeneration %}
        {%- endif %}
    {%- else %}
        {{- '<' + message['role'] + '>\n' + message['content'] | trim + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<assistant>\n' }}
{%- endif %}
"""

RENDER_TEMPLATES = {
    "features": FEATURES_TEMPLATE,
    "tools": TOOLS_TEMPLATE,
    "plus": "A\n   {%+ generation %}\n   X\n   {% endgeneration +%}\n   B",
    "minus": "A\n   {%- generation %}\n   X\n   {% endgeneration -%}\n   B",
}

RENDER_CONVERSATIONS = {
    "plain": [
        {"role": "user", "content": "Hi there, what is up?", "name": "bob"},
        {"role": "assistant", "content": " a banana a day "},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "Ça va 🙂"},
    ],
    "tool_call": [
        {"role": "system", "content": "you are a robot"},
        {"role": "user", "content": "What's the weather in Denver?"},
        {"role": "assistant", "content": "Let me check", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Denver", "unit": "C"}}},
        ]},
        {"role": "tool", "content": '{"temperature": "72F"}'},
        {"role": "assistant", "content": "  It's 72F in Denver.  "},
    ],
}

PROMPT_COMPLETION = [
    {"prompt": "Question: what does ZeRO shard?\nAnswer:", "completion": " The optimizer states."},
    {"prompt": "Über naïve café", "completion": " — 日本語のテキスト 🙂"},
    {"prompt": "", "completion": "An empty prompt trains every token."},
    {"prompt": "The quick brown", "completion": "fox jumps"},
]


def llama3_tokenizer():
    tok = Tokenizer.from_file(str(TOKENS / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        ),
    ])
    return tok


def write_dir(name, tok, config, jinja=None):
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"), pretty=False)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


def chat_cases(d):
    hf = AutoTokenizer.from_pretrained(str(d))
    cases = []
    for messages in CONVERSATIONS:
        text = hf.apply_chat_template(messages, tokenize=False)
        out = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert any(out["assistant_masks"]), "the template marked nothing"
        cases.append({
            "text": text,
            "input_ids": list(out["input_ids"]),
            "assistant_masks": list(out["assistant_masks"]),
        })
    return cases


def prompt_completion_cases(tok, eos):
    eos_id = tok.token_to_id(eos)
    cases = []
    for row in PROMPT_COMPLETION:
        prompt, completion = row["prompt"], row["completion"]
        enc = tok.encode(prompt + completion, add_special_tokens=True)
        ids = list(enc.ids)
        # Offsets are characters here, bytes in zerodp: the same tokens either way.
        trained = [s >= len(prompt) and e > s for (s, e) in enc.offsets]
        if ids and ids[-1] == eos_id:
            trained[-1] = True
        else:
            ids.append(eos_id)
            trained.append(True)
        cases.append({"ids": ids, "trained": [int(t) for t in trained]})
    return cases


def render_cases():
    cases = []
    for tname, template in RENDER_TEMPLATES.items():
        for cname, messages in RENDER_CONVERSATIONS.items():
            if tname == "features" and cname == "tool_call":
                continue
            for agp in (False, True):
                out, indices = render_jinja_template(
                    conversations=[messages], chat_template=template,
                    return_assistant_tokens_mask=True, add_generation_prompt=agp,
                    bos_token="<s>", eos_token="</s>",
                )
                text = out[0]
                byte = lambda i: len(text[:i].encode())  # noqa: E731
                cases.append({
                    "template": tname, "messages": cname, "add_generation_prompt": agp,
                    "text": text, "ranges": [[byte(a), byte(b)] for a, b in indices[0]],
                })
    return {"templates": RENDER_TEMPLATES, "conversations": RENDER_CONVERSATIONS, "cases": cases}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    llama3 = write_dir("llama3", llama3_tokenizer(), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        },
        "chat_template": LLAMA3_TEMPLATE,
    })
    chatml = write_dir("chatml", Tokenizer.from_file(str(TOKENS / "tokenizer_qwen2.json")), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": without_generation(CHATML_TEMPLATE),
    }, jinja=CHATML_TEMPLATE)
    write_jsonl(OUT / "messages.jsonl", [{"messages": m} for m in CONVERSATIONS])
    write_jsonl(OUT / "prompt_completion.jsonl", PROMPT_COMPLETION)
    expected = {
        "llama3": chat_cases(llama3),
        "chatml": chat_cases(chatml),
        "prompt_completion_llama3": prompt_completion_cases(
            Tokenizer.from_file(str(llama3 / "tokenizer.json")), "<|eot_id|>"
        ),
        "render_cases": render_cases(),
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
