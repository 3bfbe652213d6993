"""openai/chat_template.py against transformers' apply_chat_template(..., tokenize=False): the
embedded model's template, a Llama-3 and a Qwen2.5 template (from their models' published
tokenizer_config.json), and the sandbox's globals, filters and variables."""

from __future__ import annotations

import copy
import datetime

import pytest

from service.api.errors import BadInput
from service.api.openai.chat_template import compiled, render
from service.model.files import default_model_path

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
          "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen/Qwen2.5-7B-Instruct
QWEN25 = ('{%- if tools %}\n'
          "    {{- '<|im_start|>system\\n' }}\n"
          "    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- messages[0]['content'] }}\n"
          '    {%- else %}\n'
          "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
          '\n'
          '    {%- endif %}\n'
          '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user'
          ' query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags'
          ':\\n<tools>" }}\n'
          '    {%- for tool in tools %}\n'
          '        {{- "\\n" }}\n'
          '        {{- tool | tojson }}\n'
          '    {%- endfor %}\n'
          '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function n'
          'ame and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\"name\\'
          '": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n"'
          ' }}\n'
          '{%- else %}\n'
          "    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
          '    {%- else %}\n'
          "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a he"
          "lpful assistant.<|im_end|>\\n' }}\n"
          '    {%- endif %}\n'
          '{%- endif %}\n'
          '{%- for message in messages %}\n'
          '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) o'
          'r (message.role == "assistant" and not message.tool_calls) %}\n'
          "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '"
          "\\n' }}\n"
          '    {%- elif message.role == "assistant" %}\n'
          "        {{- '<|im_start|>' + message.role }}\n"
          '        {%- if message.content %}\n'
          "            {{- '\\n' + message.content }}\n"
          '        {%- endif %}\n'
          '        {%- for tool_call in message.tool_calls %}\n'
          '            {%- if tool_call.function is defined %}\n'
          '                {%- set tool_call = tool_call.function %}\n'
          '            {%- endif %}\n'
          '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
          '            {{- tool_call.name }}\n'
          '            {{- \'", "arguments": \' }}\n'
          '            {{- tool_call.arguments | tojson }}\n'
          "            {{- '}\\n</tool_call>' }}\n"
          '        {%- endfor %}\n'
          "        {{- '<|im_end|>\\n' }}\n"
          '    {%- elif message.role == "tool" %}\n'
          '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
          "            {{- '<|im_start|>user' }}\n"
          '        {%- endif %}\n'
          "        {{- '\\n<tool_response>\\n' }}\n"
          '        {{- message.content }}\n'
          "        {{- '\\n</tool_response>' }}\n"
          '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
          "            {{- '<|im_end|>\\n' }}\n"
          '        {%- endif %}\n'
          '    {%- endif %}\n'
          '{%- endfor %}\n'
          '{%- if add_generation_prompt %}\n'
          "    {{- '<|im_start|>assistant\\n' }}\n"
          '{%- endif %}\n')
# transformers' globals, filters and variables, each used once
FEATURES = (
    "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- continue %}{%- endif %}{%- set ns.n = ns.n + 1 %}"
    "[{{ m.role }}#{{ ns.n }}]{{ m.content }}{% generation %}|{% endgeneration %}\n"
    "{%- endfor %}{{ bos_token }}{{ eos_token }}{{ pad_token }}"
    "{{ {'ü': [1, 2], 'a': none} | tojson }}"
    "{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}"
    "{{ dict(x=1) | tojson }}{{ strftime_now('%Y') }}{{ flavour | default('plain') }}"
    "{% if add_generation_prompt %}<go>{% endif %}")
# loops over each message's content parts (vLLM's "openai" content format)
PARTS = ("{% for message in messages %}{{ message['role'] }}:{% for part in message['content'] %}"
         "<{{ part['type'] }}={{ part['text'] }}>{% endfor %};{% endfor %}")

SYSTEM = {"role": "system", "content": "You answer in one word."}
USER = {"role": "user", "content": "What is the capital of France? "}
ASSISTANT = {"role": "assistant", "content": "The capital is "}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]


@pytest.fixture(scope="module")
def hf():
    import transformers

    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def with_template(tokenizer, template):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def hf_render(hf, template, messages, **kw):
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


def ours(tokenizer, template, messages, add_generation_prompt=False,
         continue_final_message=False, **kw):
    return render(with_template(tokenizer, template), messages,
                  add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, **kw)


CONVERSATIONS = {
    "user": [USER],
    "system": [SYSTEM, USER],
    "reply": [SYSTEM, USER, {"role": "assistant", "content": "Paris."}, USER],
}


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen25"])
@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_same_text_as_transformers(tokenizer, hf, name, conv, gen) -> None:
    template = {"smollm2": tokenizer.chat_template, "llama3": LLAMA3, "qwen25": QWEN25}[name]
    messages = CONVERSATIONS[conv]
    want = hf_render(hf, template, messages, add_generation_prompt=gen)
    assert ours(tokenizer, template, messages, add_generation_prompt=gen) == want


@pytest.mark.parametrize("template", ["smollm2", LLAMA3, QWEN25])
def test_continue_final_message(tokenizer, hf, template) -> None:
    """The last message stays open (a trailing space is kept, or trimmed as the template does:
    Llama-3 `| trim`s each message)."""
    template = tokenizer.chat_template if template == "smollm2" else template
    messages = [SYSTEM, USER, ASSISTANT]
    want = hf_render(hf, template, messages, continue_final_message=True)
    got = ours(tokenizer, template, messages, continue_final_message=True)
    assert got == want and got.rstrip().endswith("The capital is")


def test_list_of_parts_is_joined_as_vllm_joins_them(tokenizer, hf) -> None:
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of Italy?"}]
    for template in (tokenizer.chat_template, LLAMA3, QWEN25):
        joined = hf_render(hf, template, [SYSTEM, {"role": "user", "content":
                                                    "What is the capital\nof Italy?"}],
                           add_generation_prompt=True)
        assert ours(tokenizer, template, [SYSTEM, {"role": "user", "content": parts}],
                    add_generation_prompt=True) == joined


def test_a_template_that_loops_over_content_gets_parts(tokenizer, hf) -> None:
    """A string content becomes one text part there (vLLM); transformers renders the parts."""
    assert compiled(PARTS)[1] and not compiled(QWEN25)[1] and not compiled(LLAMA3)[1]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]
    want = hf_render(hf, PARTS, as_parts)
    assert want == "user:<text=Hi>;assistant:<text=Yo>;"
    assert ours(tokenizer, PARTS, [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Yo"}]) == want
    loop_var = PARTS.replace("in messages", "in msgs").replace("{% for", "{% set msgs = "
                                                                 "messages[1:] %}{% for", 1)
    assert compiled(loop_var)[1]


def test_tools_and_tool_calls(tokenizer, hf) -> None:
    """Tools go to the template as sent; a tool call's JSON arguments as an object (vLLM)."""
    parsed = copy.deepcopy(TOOL_TURN)
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = hf_render(hf, QWEN25, parsed, tools=TOOLS, add_generation_prompt=True)
    assert "°C" in want and '{"city": "Paris"}' in want
    assert ours(tokenizer, QWEN25, TOOL_TURN, tools=TOOLS, add_generation_prompt=True) == want


def test_globals_filters_and_kwargs(tokenizer, hf) -> None:
    messages = [SYSTEM, USER, {"role": "assistant", "content": "Paris"}]
    for kwargs in ({}, {"flavour": "spicy"}, {"eos_token": "</s>"}):
        want = hf_render(hf, FEATURES, messages, add_generation_prompt=True, **kwargs)
        got = ours(tokenizer, FEATURES, messages, add_generation_prompt=True,
                   chat_template_kwargs=kwargs)
        assert got == want
    assert '{"ü": [1, 2], "a": null}' in got and str(datetime.date.today().year) in got
    assert "</s>" in got and "spicy" not in got


def test_refusals_name_what_is_wrong(tokenizer) -> None:
    refuses = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    cases = [
        (None, [USER], {}, "no chat template", "messages"),
        (refuses, [USER], {}, "roles must alternate", "messages"),
        ("{{ messages[0].content.upper(1) }}", [USER], {}, "TypeError", "messages"),
        ("{{ ''.__class__ }}{{ ().__class__.__base__.__subclasses__() }}", [USER], {},
         "failed", "messages"),
        ("{% for %}", [USER], {}, "does not compile", "messages"),
        (LLAMA3, [USER], {"chat_template_kwargs": {"messages": []}}, "set by the request",
         "chat_template_kwargs.messages"),
        (LLAMA3, [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "http://x/y.png"}}]}], {}, "'image_url' parts are not supported",
         "messages[0].content[0].type"),
        (LLAMA3, [{"role": "user", "content": [{"type": "text"}]}], {}, "has no text",
         "messages[0].content[0].text"),
        (LLAMA3, [{"role": "robot", "content": "beep"}], {}, "Input should be",
         "messages[0].role"),
        (LLAMA3, [USER, ASSISTANT], {"add_generation_prompt": True,
                                     "continue_final_message": True}, "cannot both",
         "continue_final_message"),
        ("{{ messages[0].role }}", [USER, ASSISTANT], {"continue_final_message": True},
         "does not render", "continue_final_message"),
    ]
    for template, messages, kw, words, param in cases:
        with pytest.raises(BadInput) as err:
            ours(tokenizer, template, messages, **kw)
        assert words in err.value.message and err.value.param == param, err.value.message
