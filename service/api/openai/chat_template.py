"""The model's chat template, rendered as transformers' `apply_chat_template(tokenize=False)` does
(its Jinja sandbox, globals, variables), on messages parsed as vLLM parses them; compiled once."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import ValidationError

from service.api import json_depth
from service.api.errors import BadInput
from service.api.openai.schemas import ChatMessage, ToolCall
from service.model.tokenizer import TextTokenizer
from service.text import clip

# Variables render() sets itself; chat_template_kwargs may set any other
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
            "chat_template", "tokenize")
# Marks the message to continue, cut with all after it; its space shows a template's `| trim`
_CUT = "<|continue-final-message|> "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}` (transformers' training-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict:
    """`dict(...)` without the type itself (its attributes) in the template's reach."""
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the attribute {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict,
                       namespace=_Namespace)
    return env


_ENV = _environment()


@functools.lru_cache(maxsize=8)
def compiled(source: str) -> tuple[jinja2.Template, bool]:
    """The template, and whether it loops over a message's content (vLLM's "openai" format)."""
    try:
        ast = _ENV.parse(source)
        return _ENV.from_string(ast), _loops_over_content(ast)
    except jinja2.TemplateSyntaxError as e:
        raise BadInput(f"the model's chat template does not compile (line {e.lineno}: "
                       f"{e.message})", "messages") from None


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """`node` reads one of `names` (or its `[key]`), through filters, tests and slices."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        if node.node is None:
            return False
        node = node.node
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            return node.arg.value == key and _reads(node.node, names)
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == key and _reads(node.node, names)
        return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection: a loop over `message['content']` of each message."""
    lists = {"messages"}
    while True:  # {% set loop_messages = messages[1:] %}, and so on
        more = {a.target.name for a in ast.find_all(jinja2.nodes.Assign)
                if isinstance(a.target, jinja2.nodes.Name) and _reads(a.node, lists)}
        if more <= lists:
            break
        lists |= more
    loops = list(ast.find_all(jinja2.nodes.For))
    each = {f.target.name for f in loops
            if isinstance(f.target, jinja2.nodes.Name) and _reads(f.iter, lists)}
    return any(_reads(f.iter, each, "content") for f in loops)


def special_tokens(tokenizer: TextTokenizer) -> dict[str, str]:
    """The template variables transformers sets from the tokenizer's special tokens."""
    named = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
             "pad_token": tokenizer.pad_id}
    return {k: s for k, i in named.items() if (s := tokenizer.token_str(i)) is not None}


_TEXT_PARTS = ("text", "input_text", "output_text")  # vLLM reads the `text` of these


def texts(m: ChatMessage, where: str) -> list[str]:
    """The texts of a message's content; any other part is refused by name."""
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [m.content]
    out = []
    for j, part in enumerate(m.content):
        if part.type not in _TEXT_PARTS:
            raise BadInput(f"{where}.content[{j}]: {clip(part.type, 40)!r} parts are not "
                           "supported: the served model reads text only (parts of type "
                           "\"text\")", f"{where}.content[{j}].type")
        if part.text is None:
            raise BadInput(f"{where}.content[{j}] has no text", f"{where}.content[{j}].text")
        out.append(part.text)
    return out


def _tool_call(call: ToolCall, where: str) -> dict[str, Any]:
    """As sent, with the arguments as an object (vLLM parses the JSON text; none is {})."""
    out = call.model_dump(exclude_unset=True)
    args, field = call.function.arguments, f"{where}.function.arguments"
    if isinstance(args, str) and args:
        try:
            args = json_depth.loads(args)
        except ValueError as e:
            raise BadInput(f"{field} {e}", field) from None
    elif json_depth.too_deep(args):
        raise BadInput(f"{field} {json_depth.TOO_DEEP}", field)
    out["function"]["arguments"] = args or {}
    return out


_UNION_TAGS = ("str", "list", "dict", "none")  # pydantic's names of a union's members in `loc`


def _as_message(m: ChatMessage | Mapping[str, Any], i: int) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    try:
        return ChatMessage.model_validate(m)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # a union: its closest member
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
                        if isinstance(p, int) or not ("[" in p or p in _UNION_TAGS))
        raise BadInput(f"messages[{i}]{where}: {err['msg']}", f"messages[{i}]{where}") from None


def conversation(messages: Sequence[ChatMessage | Mapping[str, Any]],
                 as_parts: bool) -> list[dict[str, Any]]:
    """What the template sees of each message: vLLM's fields, transformers' reasoning aliases."""
    out = []
    for i, raw in enumerate(messages):
        m = _as_message(raw, i)
        parts = texts(m, f"messages[{i}]")
        msg: dict[str, Any] = {
            "role": m.role,
            "content": [{"type": "text", "text": t} for t in parts] if as_parts
            else "\n".join(parts)}
        if m.role == "assistant" and m.tool_calls is not None:
            msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if m.role == "assistant" and reasoning is not None:
            msg.update(reasoning=reasoning, reasoning_content=reasoning, thinking=reasoning)
        out.append(msg)
    return out


def generation_prompt(add: bool | None, continue_final_message: bool) -> bool:
    """add_generation_prompt as vLLM resolves it (true unless continuing); both true is a 400."""
    if add and continue_final_message:
        raise BadInput("continue_final_message and add_generation_prompt cannot both be true: "
                       "continue the last message or start a new one", "continue_final_message")
    return not continue_final_message if add is None else add


def render(tokenizer: TextTokenizer, messages: Sequence[ChatMessage | Mapping[str, Any]], *,
           add_generation_prompt: bool, continue_final_message: bool,
           chat_template_kwargs: Mapping[str, Any] | None = None,
           tools: list[dict[str, Any]] | None = None,
           documents: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a conversation under the model's chat template; no template, or one
    that refuses, fails or drops the continued message, is a BadInput (400) that says so."""
    if tokenizer.chat_template is None:
        raise BadInput("the served model has no chat template, so chat requests cannot be "
                       "rendered; send the formatted prompt to /v1/completions", "messages")
    if not messages:
        raise BadInput("messages is empty", "messages")
    generation_prompt(add_generation_prompt, continue_final_message)
    for key in chat_template_kwargs or {}:
        if key in RESERVED or key == "self":
            why = ("it is set by the request itself" if key in RESERVED
                   else "`self` in a Jinja template is the template itself")
            raise BadInput(f"chat_template_kwargs.{key} is not allowed: {why}",
                           f"chat_template_kwargs.{clip(key)}")
    for field, value in (("tools", tools), ("documents", documents),
                         ("chat_template_kwargs", chat_template_kwargs)):
        if json_depth.too_deep(value):
            raise BadInput(f"{field} {json_depth.TOO_DEEP}", field)
    template, as_parts = compiled(tokenizer.chat_template)
    chat = conversation(messages, as_parts)
    final = ""
    if continue_final_message:
        final = _mark_final(chat, tokenizer.chat_template)
    variables = {**special_tokens(tokenizer), **(chat_template_kwargs or {})}
    try:
        text = template.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # NOTE: the template is code: whatever it raises is its refusal
        raise BadInput(f"the model's chat template failed on these messages: "
                       f"{type(e).__name__}: {clip(str(e), 500)}", "messages") from None
    return _cut_at_mark(text, final) if continue_final_message else text


def _mark_final(chat: list[dict[str, Any]], source: str) -> str:
    """Append the cut mark to the last message's (last text part's) content; its text."""
    if "content" not in source:
        raise BadInput("continue_final_message: the model's chat template does not render a "
                       "message's content", "continue_final_message")
    content = chat[-1]["content"]
    if isinstance(content, str):
        chat[-1]["content"] = content + _CUT
        return content
    if not content:
        raise BadInput("continue_final_message: the last message has no text to continue",
                       "continue_final_message")
    part = content[-1]
    part["text"], text = part["text"] + _CUT, part["text"]
    return text


def _cut_at_mark(text: str, final: str) -> str:
    mark = text.rfind(_CUT.rstrip())
    if mark < 0 or final.strip() not in text:
        raise BadInput("continue_final_message: the model's chat template does not write the "
                       "last message as given, so it cannot be continued",
                       "continue_final_message")
    if text.startswith(_CUT, mark):
        return text[:mark]
    return text[:mark].rstrip()  # the template trimmed the message's trailing space
