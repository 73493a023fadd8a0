"""Renders a chat template the way Hugging Face transformers' `apply_chat_template` does:
Jinja2's sandbox with trim_blocks, lstrip_blocks and loop controls, `tojson` as
`json.dumps`, `raise_exception`. The oracle for kvplug's own rendering (minijinja).

Reads one JSON object on stdin — template, messages, tools (or null),
add_generation_prompt, bos_token, eos_token — and writes the rendering to stdout.
"""

import json
import sys

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


job = json.load(sys.stdin)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
template = env.from_string(job.pop("template"))
sys.stdout.write(template.render(**job))
