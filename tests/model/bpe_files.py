"""Small byte-level BPE GGUF files (tokenizer model "gpt2"), metadata only, in the shapes real
files give their vocabularies: Llama 3's (its split regex, BOS added, no ``<|endoftext|>``),
Qwen2's (its split regex, no BOS) and SmolLM2's (ByteLevel's own split, EOS added), each with
merges, control and user-defined tokens, a token spelled with raw spaces and a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from hybridspec.model.bpe_tokenizer import bytes_to_unicode

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}"
    "{%- endif %}\n"
    '{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}\n'
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{%- if tools is not none and not tools_in_user_message %}\n"
    '    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}\n'
    "{%- endif %}\n"
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    '        {{- raise_exception("Cannot put tools in the first user message.") }}\n'
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}\n'
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool'"
    " or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    '        {{- \'"parameters": \' }}{{- tool_call.arguments | tojson }}{{- "}" }}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    "        {{- message.content | tojson if message.content is mapping else message.content }}\n"
    '        {{- "<|eot_id|>" }}\n'
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(n=0) %}"
    "{%- for message in messages %}{%- set ns.n = ns.n + 1 %}"
    "{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

# merges over the byte alphabet ("Ġ" is a space): words, digits, an emoji's first bytes
_MERGES = [
    "Ġ t", "h e", "Ġt he", "i n", "in g", "Ġ a", "e r", "o n", "Ġ w", "o r",
    "1 2", "12 3", "ð Ł", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "Ġ (", "( )", "Ġ =", "d e",
    "Ġ h", "Ġh e", "l l", "Ġhe ll", "Ġhell o", "H e", "He ll", "Hell o", "ĠĠ Ġ",
]  # fmt: skip


def _vocabulary(specials: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    spelling = bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)]
    for merge in _MERGES:
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
    types = [1] * len(tokens)
    tokens.append(" hi")  # a token spelled with a raw space (respelled "Ġhi")
    types.append(1)
    for token, kind in specials:
        tokens.append(token)
        types.append(kind)
    return tokens, types


KINDS: dict[str, dict[str, Any]] = {
    "llama3": dict(
        arch="llama",
        pre="llama-bpe",
        specials=[
            ("<|begin_of_text|>", 3),
            ("<|end_of_text|>", 3),
            ("<|start_header_id|>", 3),
            ("<|end_header_id|>", 3),
            ("<|eot_id|>", 3),
            ("<|reserved special token|>", 3),  # a space: not byte-level, not added
            ("<think>", 4),
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        add_bos=True,
        template=LLAMA3_TEMPLATE,
    ),
    "qwen2": dict(
        arch="qwen2",
        pre="qwen2",
        specials=[("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)],
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template=QWEN_TEMPLATE,
    ),
    "smollm": dict(
        arch="llama",
        pre="smollm",
        specials=[("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)],
        bos="<|im_start|>",
        eos="<|im_end|>",
        unk="<|endoftext|>",
        add_eos=True,
        template=None,
    ),
}


def write_bpe_gguf(path: Path, kind: str) -> Path:
    """A metadata-only GGUF file holding ``KINDS[kind]``'s vocabulary."""
    spec = KINDS[kind]
    tokens, types = _vocabulary(spec["specials"])
    writer = GGUFWriter(str(path), spec["arch"])
    writer.add_name(f"tiny {kind}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        if spec.get(key):
            add(tokens.index(spec[key]))
    if spec.get("pad"):
        writer.add_pad_token_id(tokens.index(spec["pad"]))
    if spec.get("unk"):
        writer.add_unk_token_id(tokens.index(spec["unk"]))
    if "add_bos" in spec:
        writer.add_add_bos_token(spec["add_bos"])
    if "add_eos" in spec:
        writer.add_add_eos_token(spec["add_eos"])
    if spec["template"] is not None:
        writer.add_chat_template(spec["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
