"""An Ollama Modelfile whose TEMPLATE renders exactly what the Hugging Face chat template renders.

Ollama templates are Go text/template, chat templates are Jinja: no general translation exists. But the
templates of chat models wrap each message in fixed per-role text (Gemma 3's folds a leading system message
into the first user turn instead: the one variation read off too, `system_in_first_user`). We probe the HF template with marker
contents to read off those pieces (the text before the first system message, before/after each role's
content, the default system block used when a conversation has none, the generation prompt), check that
reassembling the pieces reproduces the HF rendering for several conversations, and write them into a Go
template. A template that is not of this shape (content rewritten by the template, role-dependent
logic beyond wrapping) is refused with a clear error rather than exported wrong.
tests/test_export_modelfile.py renders the result with Go's text/template and compares string for string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reprotune.errors import ReprotuneError

# lower-case markers: a template that changes case (or strips, escapes, ...) no longer contains them
S, U, A, U2 = "\x01sys\x01", "\x01usr\x01", "\x01ast\x01", "\x01usr2\x01"


@dataclass(frozen=True)
class ChatPieces:
    system_first: str  # everything before the content of a leading system message (BOS included)
    system_end: str
    nosystem_first: str  # before the first user message when there is no system message (default system)
    user_begin: str
    user_end: str
    assistant_begin: str
    assistant_end: str
    generation_prompt: str
    # Gemma 3: a leading system message opens the first user turn (system_first ends with user_begin) and that
    # user message then has no user_begin of its own
    system_in_first_user: bool = False


def _between(text: str, left: str, right: str) -> str:
    i, j = text.index(left) + len(left), text.index(right)
    return text[i:j]


def _strip_prefix(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
        raise ReprotuneError(f"modelfile: the chat template does not wrap messages uniformly ({what}); "
                            "write the Ollama TEMPLATE by hand")
    return text[len(prefix):]


def probe(tokenizer) -> ChatPieces:
    """Read the per-role wrapping off the tokenizer's chat template."""

    def render(messages: list[dict], generation: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    sys_, usr, ast, usr2 = ({"role": "system", "content": S}, {"role": "user", "content": U},
                            {"role": "assistant", "content": A}, {"role": "user", "content": U2})
    try:
        full = render([sys_, usr, ast, usr2])
        ends_user = render([sys_, usr])
        ends_assistant = render([sys_, usr, ast])
        with_prompt = render([sys_, usr], generation=True)
        nosys = render([usr, ast])
    except Exception as err:  # the template rejected a plain system/user/assistant conversation
        raise ReprotuneError(f"modelfile: the chat template cannot render a plain conversation ({err}); "
                            "write the Ollama TEMPLATE by hand") from None
    if any(m not in full for m in (S, U, A, U2)):
        raise ReprotuneError("modelfile: the chat template rewrites message contents; write the Ollama TEMPLATE by hand")
    user_end = ends_user[ends_user.index(U) + len(U):]
    assistant_end = ends_assistant[ends_assistant.index(A) + len(A):]
    system_to_user = _between(full, S, U)
    user_to_assistant = _between(full, U, A)
    assistant_to_user = _between(full, A, U2)
    user_begin = _strip_prefix(assistant_to_user, assistant_end, "assistant end")
    system_first = full[: full.index(S)]
    folded = not system_to_user.endswith(user_begin) and system_first.endswith(user_begin)
    system_end = system_to_user if folded else system_to_user[: len(system_to_user) - len(user_begin)]
    if not (folded or system_to_user.endswith(user_begin)):
        raise ReprotuneError("modelfile: the chat template opens a user turn differently after a system "
                            "message; write the Ollama TEMPLATE by hand")
    pieces = ChatPieces(
        system_first=system_first,
        system_end=system_end,
        nosystem_first=_strip_prefix(nosys[: nosys.index(U)][::-1], user_begin[::-1], "default system")[::-1],
        user_begin=user_begin,
        user_end=user_end,
        assistant_begin=_strip_prefix(user_to_assistant, user_end, "assistant begin"),
        assistant_end=assistant_end,
        generation_prompt=_strip_prefix(with_prompt, ends_user, "generation prompt"),
        system_in_first_user=folded,
    )
    check_pieces(pieces, render)
    return pieces


def assemble(pieces: ChatPieces, messages: list[dict], generation: bool) -> str:
    """What the Go template renders, in Python: used to check the pieces against the HF template."""
    out = [] if messages and messages[0]["role"] == "system" else [pieces.nosystem_first]
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out += [pieces.system_first if i == 0 else "", m["content"], pieces.system_end]
        elif m["role"] == "user":
            opens = not (pieces.system_in_first_user and i == 1 and messages[0]["role"] == "system")
            out += [pieces.user_begin if opens else "", m["content"], pieces.user_end]
        else:
            out += [pieces.assistant_begin, m["content"], pieces.assistant_end]
    if generation and messages[-1]["role"] != "assistant":
        out.append(pieces.generation_prompt)
    return "".join(out)


def check_pieces(pieces: ChatPieces, render) -> None:
    convs = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Total?\nIt is 12."}],
        [{"role": "system", "content": "x"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
    for conv in convs:
        # like Ollama: a generation prompt follows a conversation that does not end with the assistant
        generation = conv[-1]["role"] != "assistant"
        if assemble(pieces, conv, generation) != render(conv, generation):
            raise ReprotuneError("modelfile: the chat template has role logic beyond fixed wrapping; "
                                "write the Ollama TEMPLATE by hand")


def _go_literal(text: str) -> str:
    """Literal text inside a Go template ('{{' would open an action)."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(p: ChatPieces) -> str:
    """A Go text/template over Ollama's .Messages (Role, Content) that renders like assemble().

    No whitespace-trimming actions ({{- ... -}}): the pieces' own newlines are part of the format."""
    g = _go_literal
    user_begin = g(p.user_begin)
    if p.system_in_first_user:  # the user message right after a leading system message continues its turn
        user_begin = ('{{ if not (and (eq $i 1) (eq (index $.Messages 0).Role "system")) }}'
                      f"{user_begin}{{{{ end }}}}")
    return (
        "{{ range $i, $m := .Messages }}"
        f'{{{{ if and (eq $i 0) (ne $m.Role "system") }}}}{g(p.nosystem_first)}{{{{ end }}}}'
        f'{{{{ if eq $m.Role "system" }}}}{{{{ if eq $i 0 }}}}{g(p.system_first)}{{{{ end }}}}'
        f"{{{{ $m.Content }}}}{g(p.system_end)}"
        f'{{{{ else if eq $m.Role "user" }}}}{user_begin}{{{{ $m.Content }}}}{g(p.user_end)}'
        f'{{{{ else if eq $m.Role "assistant" }}}}{g(p.assistant_begin)}{{{{ $m.Content }}}}{g(p.assistant_end)}'
        "{{ end }}"
        '{{ if and (eq (len (slice $.Messages $i)) 1) (ne $m.Role "assistant") }}'
        f"{g(p.generation_prompt)}{{{{ end }}}}"
        "{{ end }}"
    )


# a model trained on raw text (text preference pairs) is prompted with the text as it is: Ollama's prompt, no turns
RAW_TEMPLATE = "{{ .Prompt }}"


def eos_stop_tokens(tokenizer, eos_ids: list[int]) -> list[str]:
    """The model's eos ids as the tokens Ollama stops on."""
    return sorted({tokenizer.convert_ids_to_tokens(i) for i in eos_ids})


def stop_tokens(tokenizer, pieces: ChatPieces, eos_ids: list[int]) -> list[str]:
    """Every token that ends a turn: the model's eos ids and the special tokens closing an assistant turn."""
    names = eos_stop_tokens(tokenizer, eos_ids)
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                   if t.special}
    names += [t for t in special if t in pieces.assistant_end]
    return sorted(set(names))


def training_system_prompt(train_file: Path) -> str | None:
    """The system prompt every training conversation starts with, if they all share one (preference rows: the
    prompt's messages; a text prompt has none)."""
    if not train_file.is_file():
        return None
    prompts = set()
    with open(train_file, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                messages = row["messages"] if "messages" in row else row.get("prompt")
                first = messages[0] if isinstance(messages, list) and messages else {}
                prompts.add(first.get("content") if first.get("role") == "system" else None)
    return prompts.pop() if len(prompts) == 1 else None


def _quote(text: str) -> str:
    if '"""' in text:
        raise ReprotuneError('modelfile: the template or system prompt contains """, which a Modelfile cannot hold')
    return f'"""{text}"""'


def render_modelfile(gguf_name: str, template: str, stops: list[str], system: str | None) -> str:
    lines = ["# Ollama: ollama create <name> -f Modelfile   (written by reprotune.gguf)",
             f"FROM ./{gguf_name}", f"TEMPLATE {_quote(template)}"]
    lines += [f"PARAMETER stop {json.dumps(s, ensure_ascii=False)}" for s in stops]
    if system:
        lines.append(f"SYSTEM {_quote(system)}")
    return "\n".join(lines) + "\n"


def parse_modelfile(text: str) -> dict[str, list[str]]:
    """Instructions of a Modelfile (as Ollama reads them: triple-quoted values may span lines)."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(text):
        if text[i] in "\n " or text.startswith("#", i):
            i = text.index("\n", i) + 1 if text.startswith("#", i) else i + 1
            continue
        name, _, rest = text[i:].partition(" ")
        if rest.startswith('"""'):
            end = rest.index('"""', 3)
            value, consumed = rest[3:end], len(name) + 1 + end + 3
        else:
            value = rest.split("\n", 1)[0]
            consumed = len(name) + 1 + len(value)
        out.setdefault(name.upper(), []).append(value)
        i += consumed
    return out

