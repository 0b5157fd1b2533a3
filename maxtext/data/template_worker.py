"""The chat-template renderer process: compiles one Jinja chat template and renders conversations into pieces.

Run as a script by maxtext.data.chat_template (never imported by it: it needs only the standard library and jinja2,
so it starts in a fraction of a second). It talks newline-delimited JSON over stdin/stdout:

  <- {"ready": true}                                    once started
  -> {"source": str, "max_chars": int, "max_bytes": int}
  <- {"ok": true} | {"error": str, "line": int | null}  the template compiled, or why not (line: a syntax error's)
  -> {"messages": [{"role", "content"}, ...], "special": {name: text}}
  <- {"pieces": [[text, trainable], ...]} | {"error": str}

The parent bounds each answer's wall time and kills this process when it is late; this process limits its own
address space (RLIMIT_AS, so a template that builds a huge value fails with MemoryError here, not in the trainer)
and the characters each render may produce. Two backstops end it when nobody waits for it any more: a watchdog
thread exits the process once its parent is gone (it runs between the template's bytecodes), and each request may use
at most CPU_SECONDS_PER_REQUEST of CPU time (RLIMIT_CPU, raised before each request), so an endless loop never
outlives the run that started it.
"""

import sys

if sys.path and sys.path[0]:  # this file's directory (maxtext/data): keep its modules from shadowing any jinja2 imports
  sys.path.pop(0)

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jinja2  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

NOT_PREFIX = "not_prefix"  # the error of a template whose output does not only grow turn by turn
CPU_SECONDS_PER_REQUEST = 60  # far above the parent's wall-time deadline: only reached when the parent is gone or stuck
PARENT_CHECK_SECONDS = 1.0  # how often the watchdog looks for the parent


class TooLong(Exception):
  pass


class NotPrefix(Exception):
  pass


def raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


class Sandbox(ImmutableSandboxedEnvironment):
  """Jinja's immutable sandbox, whose arithmetic runs when the template renders: compiling never folds a huge
  constant such as `'x' * 300000000` into the compiled code (where neither the deadline nor the output limit applies
  as precisely)."""

  intercepted_binops = frozenset(["*", "**", "+", "%", "//", "/"])


def compile_template(source: str):
  """A sandboxed template rendered as Hugging Face renders chat templates."""
  env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = raise_exception
  return env.from_string(source)


def render(template, max_chars: int, **variables) -> str:
  """The rendered text, built chunk by chunk; more than max_chars characters raise TooLong."""
  out, size = [], 0
  for chunk in template.generate(**variables):
    size += len(chunk)
    if size > max_chars:
      raise TooLong(f"rendered more than {max_chars} characters")
    out.append(chunk)
  return "".join(out)


def pieces(template, messages: list, special: dict, max_chars: int) -> list:
  """The conversation as [text, trainable] pieces: assistant replies (after any generation prompt) are trainable.

  Renders growing prefixes of the conversation, so the template must render a prefix of the conversation as a prefix
  of the whole (true of ordinary chat templates)."""

  def text(turns: list, generation_prompt: bool) -> str:
    if not turns and not generation_prompt:
      return ""
    return render(template, max_chars, messages=turns, add_generation_prompt=generation_prompt, **special)

  out: list = []
  done = ""
  for k, turn in enumerate(messages):
    full = text(messages[: k + 1], False)
    if turn["role"] == "assistant":
      header = text(messages[:k], True)
      out += [[suffix(done, header), False], [suffix(header, full), True]]
    else:
      out.append([suffix(done, full), False])
    done = full
  return [p for p in out if p[0]]


def suffix(prefix: str, text: str) -> str:
  if not text.startswith(prefix):
    raise NotPrefix()
  return text[len(prefix) :]


def cause(e: BaseException) -> str:
  """A one-line reason: the exception's type and the start of its message."""
  if isinstance(e, TooLong):
    return str(e)
  if isinstance(e, MemoryError):
    return "MemoryError: it needs more memory than a template may use"
  if isinstance(e, RecursionError):
    return "RecursionError: it recurses too deep"
  text = " ".join(str(e).split())
  text = text[:300].rstrip(".")
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def die_with_parent() -> None:
  """Exit as soon as the parent process is gone (the renderer is then reparented): a daemon watchdog thread."""
  parent = os.getppid()

  def watch() -> None:
    while os.getppid() == parent:
      time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)

  threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def limit_cpu_for_next_request() -> None:
  """At most CPU_SECONDS_PER_REQUEST more CPU seconds; past them the kernel ends this process (SIGXCPU)."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  used = int(usage.ru_utime + usage.ru_stime) + 1
  _, hard = resource.getrlimit(resource.RLIMIT_CPU)
  soft = used + CPU_SECONDS_PER_REQUEST
  if hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def send(value: dict) -> None:
  sys.stdout.write(json.dumps(value) + "\n")
  sys.stdout.flush()


def main() -> None:
  die_with_parent()
  limit_cpu_for_next_request()
  send({"ready": True})
  setup = json.loads(sys.stdin.readline())
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  limit = setup["max_bytes"] if hard == resource.RLIM_INFINITY else min(setup["max_bytes"], hard)
  resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
  max_chars = setup["max_chars"]
  try:
    template = compile_template(setup["source"])
  except jinja2.exceptions.TemplateSyntaxError as e:
    send({"error": e.message or "invalid syntax", "line": e.lineno})
    return
  except BaseException as e:  # noqa: BLE001 - whatever compiling raises is the template's fault, reported in one line
    send({"error": cause(e), "line": None})
    return
  send({"ok": True})
  for line in sys.stdin:
    limit_cpu_for_next_request()
    request = json.loads(line)
    try:
      answer = {"pieces": pieces(template, request["messages"], request["special"], max_chars)}
    except BaseException as e:  # noqa: BLE001 - the same: one line back to the parent
      answer = {"error": NOT_PREFIX if isinstance(e, NotPrefix) else cause(e)}
    send(answer)


if __name__ == "__main__":
  main()
