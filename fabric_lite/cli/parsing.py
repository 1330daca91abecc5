"""The argument parser every `fabric-lite` command uses.

Three things plain argparse does not do:

* every multi-word flag works in both spellings, ``--num-processes`` and ``--num_processes`` (Hugging
  Face Accelerate documents underscores, torchrun dashes);
* no abbreviations: ``--run`` is not read as ``--run-path``;
* a mistyped flag gets one line naming the nearest real one, plus the usage line, instead of the
  whole usage text.

A parser made with ``script="training_script"`` (the `launch` / `explain` parsers) reads its own
options only up to the script: the script and everything after it reach the script untouched.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["CliParser", "other_spelling"]


def other_spelling(option: str) -> Optional[str]:
    """``--num-processes`` <-> ``--num_processes``; None for a short option or a one-word flag."""
    if not option.startswith("--"):
        return None
    body = option[2:]
    if "-" in body:
        return "--" + body.replace("-", "_")
    if "_" in body:
        return "--" + body.replace("_", "-")
    return None


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser for `fabric-lite` commands (see the module docstring).

    `script` / `script_args`: the destinations of a positional script and of its arguments (an
    ``argparse.REMAINDER``); argv is split at the script and only the part before it is parsed.
    """

    def __init__(self, *args: Any, script: Optional[str] = None, script_args: Optional[str] = None,
                 **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.script_dest = script
        self.script_args_dest = script_args

    # -- what the parser knows ------------------------------------------------------------------------

    def option_actions(self) -> Dict[str, argparse.Action]:
        """Every option string the parser accepts, with its action."""
        # argparse keeps its actions in `_actions`; it has no public listing of them.
        return {option: action for action in self._actions for option in action.option_strings}

    def known_spelling(self, option: str, known: Dict[str, argparse.Action]) -> Optional[str]:
        """`option` as the parser spells it (either spelling given), or None if it has no such flag."""
        if option in known:
            return option
        other = other_spelling(option)
        return other if other in known else None

    # -- splitting argv at the script -----------------------------------------------------------------

    def split_argv(self, argv: Sequence[str]) -> Tuple[List[str], Optional[str], List[str], List[str]]:
        """(the parser's own part, spellings normalized; the script or None; the script's arguments,
        untouched; the destinations of the flags given).

        Walks the options the way argparse would (a flag that takes a value takes the next token,
        ``--flag=value`` and ``-r3`` carry theirs), stops at the first positional or after ``--``."""
        known = self.option_actions()
        head: List[str] = []
        given: List[str] = []
        tokens = list(argv)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--":
                if self.script_dest is not None and i + 1 < len(tokens):
                    return head, tokens[i + 1], tokens[i + 2:], given
                head.extend(tokens[i:])
                break
            if not token.startswith("-") or token == "-" or _is_number(token):
                if self.script_dest is not None:
                    return head, token, tokens[i + 1:], given
                head.append(token)
                i += 1
                continue
            name, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
            spelled = self.known_spelling(name, known)
            inline = bool(eq)
            if spelled is None and not token.startswith("--") and token[:2] in known and len(token) > 2:
                spelled, inline = token[:2], True  # -r3: a short flag with its value attached
                name, eq, value = token[:2], "", token[2:]
            if spelled is None:  # unknown: left for parse_args to report
                head.append(token)
                i += 1
                continue
            action = known[spelled]
            given.append(action.dest)
            head.append(spelled + eq + value if eq else (spelled + value if inline else spelled))
            i += 1
            if not inline and _takes_value(action) and i < len(tokens):
                head.append(tokens[i])
                i += 1
        return head, None, [], given

    # -- parsing --------------------------------------------------------------------------------------

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None) -> Tuple[argparse.Namespace, List[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        head, script, script_args, given = self.split_argv(argv)
        if script is not None:
            head = head + (["--", script] if script.startswith("-") else [script])
        parsed, extras = super().parse_known_args(head, namespace)
        assert parsed is not None  # (argparse returns the namespace it filled)
        namespace = parsed
        if self.script_args_dest is not None and script is not None:
            setattr(namespace, self.script_args_dest, list(script_args))
        namespace.command_line = frozenset(given)  # the settings given as flags (not defaults)
        return namespace, extras

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras[0]))
        return parsed

    def unrecognized(self, token: str) -> str:
        """'unrecognized argument --num_proceses (did you mean --num_processes?)'."""
        if not token.startswith("-") or _is_number(token):
            return f"unrecognized argument {token!r}"
        name = token.partition("=")[0]
        options = [o for o in self.option_actions() if o.startswith("--")]
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"unrecognized argument {name}{hint}"

    def error(self, message: str) -> Any:  # type: ignore[override]
        """The usage line and one line of error, status 2 (argparse's status)."""
        usage = self.usage_line()
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")

    def usage_line(self) -> str:
        if self.usage is not None:
            return f"usage: {self.usage % dict(prog=self.prog)}"
        text = " ".join(self.format_usage().split())  # argparse wraps long usage over many lines
        return text if len(text) <= 160 else f"usage: {self.prog} [options] (see {self.prog} --help)"


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and action.nargs != "?"


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True
