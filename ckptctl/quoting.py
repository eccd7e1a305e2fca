"""Names from a checkpoint, made safe to show and to paste.

Folder, file and tensor names are chosen by whoever can write to a shared filesystem. Shown to a person,
their control characters are escapes (`printable`), so that none drives the terminal. In the commands and
code lines ckptctl suggests (resume settings, conversions to run first, hints in errors) they are quoted, so
that pasting one runs exactly the call it names on exactly the paths it names: a run folder named
`run $(touch PWNED)` reaches the shell as one word (`shell`), one named `n"); import os; ("` reaches Python
as one string (`python_call`), and the prose after a suggestion is a comment that no name can end (`comment`).
"""

from __future__ import annotations

import json
import re
import shlex

__all__ = ["Code", "comment", "has_control", "printable", "python_call", "shell", "yaml_value"]

#: What `printable` escapes: the C0 controls, DEL and the C1 controls (Unicode's category Cc), and the Unicode
#: line and paragraph separators, which YAML and many editors take as line breaks (a comment would end there).
#: And the surrogates: a file name that is not UTF-8 holds its bytes as U+DC80..U+DCFF (`os.fsdecode`), which
#: a stream writing with `surrogateescape` turns back into raw bytes: 0x9b is a C1 CSI.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with its control characters written as escapes (`\\x1b`, `\\x9b`, `\\x7f`, `\\n`; a byte of
    a name that is not UTF-8 as `\\xNN` too), so that nothing in it drives a terminal (clears the screen,
    sets the title, writes the clipboard) or ends a line."""
    return _CONTROL.sub(_escape, text)


def has_control(text: str) -> bool:
    """Whether `printable` would change `text`."""
    return _CONTROL.search(text) is not None


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # the byte that `surrogateescape` decoded
        code -= 0xDC00
    return _NAMED.get(char) or (f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}")


def shell(*words: str) -> str:
    """A POSIX shell command line (or the flags to add to one) of `words`, each quoted where it needs it:
    `shlex.split` of the result gives `words` back."""
    return shlex.join(words)


class Code(str):
    """Python source that a suggested call passes as written (a variable of the user's program such as
    `model`), where every other argument is a value written as a literal."""

    __slots__ = ()


def python_call(function: str, *args: object, **kwargs: object) -> str:
    """`function(arg, ..., name=value, ...)`: each argument a Python literal (`repr`), a `Code` as written.

    `function` is ckptctl's own text (`dcp.load`, `CheckpointManager('run').restore`), never a name read from
    a checkpoint.
    """
    parts = [_argument(a) for a in args] + [f"{name}={_argument(value)}" for name, value in kwargs.items()]
    return f"{function}({', '.join(parts)})"


def _argument(value: object) -> str:
    return str(value) if isinstance(value, Code) else repr(value)


def comment(*remarks: str) -> str:
    """The remarks (those not empty, joined by `; `) as a comment after a suggested line (`  # ...`), which
    the shell, Python and YAML all skip: printable, so that a line break in a name cannot end it and turn
    the rest into code. Empty without remarks."""
    said = "; ".join(r for r in remarks if r)
    return f"  # {printable(said)}" if said else ""


def yaml_value(text: str) -> str:
    """`text` as a double-quoted YAML scalar (JSON's string syntax, which YAML reads the same), so that a
    `#`, a `: ` or a line break in a path stays part of the value. Characters outside ASCII stay as they are
    (YAML readers do not join JSON's surrogate pairs), but for DEL, C1 and the Unicode line breaks, which YAML
    takes only escaped."""
    return re.sub(
        r"[\x7f-\x9f\u2028\u2029]", lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False)
    )
