"""`superfluid completion bash|zsh|fish`: shell completion for the commands and their flags.

The script is written from the parser itself, so every command and flag the `--help` pages
show completes, and nothing else. Install it once:

    superfluid completion bash > ~/.local/share/bash-completion/completions/superfluid
    superfluid completion zsh > "${fpath[1]}/_superfluid"
    superfluid completion fish > ~/.config/fish/completions/superfluid.fish
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "fish")


def command_flags(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each command (and `command verb`) with its long flags; "" for the program's own."""
    found: dict[str, list[str]] = {}

    def walk(prefix: str, current: argparse.ArgumentParser) -> None:
        shown = [action for action in current._actions if action.help != argparse.SUPPRESS]
        flags = [s for action in shown for s in action.option_strings if s.startswith("--")]
        # a positional with a fixed set of values (a shell, an agent) completes to them too
        values = [
            str(v)
            for action in shown
            if not action.option_strings and action.choices and not isinstance(action, argparse._SubParsersAction)
            for v in action.choices
        ]
        found[prefix] = sorted(values) + sorted(flags)
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)

    walk("", parser)
    return found


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for `shell`."""
    table = command_flags(parser)
    commands = sorted(name for name in table if name and " " not in name)
    verbs = {name: sorted(v.split(" ", 1)[1] for v in table if v.startswith(f"{name} ")) for name in commands}
    if shell == "fish":
        return _fish(table, commands, verbs)
    return _bash(table, commands, verbs, zsh=shell == "zsh")


def _bash(table: dict[str, list[str]], commands: list[str], verbs: dict[str, list[str]], zsh: bool) -> str:
    cases = []
    for name in commands:
        if verbs[name]:
            inner = [f'        {verb}) words="{" ".join(table[f"{name} {verb}"])}" ;;' for verb in verbs[name]]
            cases.append(
                f"    {name})\n"
                f'      case "${{COMP_WORDS[2]}}" in\n' + "\n".join(inner) + "\n"
                f'        *) words="{" ".join(verbs[name])}" ;;\n'
                "      esac ;;"
            )
        else:
            cases.append(f'    {name}) words="{" ".join(table[name])}" ;;')
    body = "\n".join(cases)
    lines = [
        "# superfluid completion (superfluid completion bash|zsh)",
        *(["autoload -U +X bashcompinit && bashcompinit"] if zsh else []),
        "_superfluid() {",
        '  local current="${COMP_WORDS[COMP_CWORD]}" words',
        '  if [ "$COMP_CWORD" -eq 1 ]; then',
        f'    words="{" ".join([*commands, *table[""]])}"',
        "  else",
        '    case "${COMP_WORDS[1]}" in',
        body,
        '    *) words="" ;;',
        "    esac",
        "  fi",
        '  COMPREPLY=($(compgen -W "$words" -- "$current"))',
        # nothing matched a word that is not a flag: a file name, such as a model's path
        '  case "$current" in -*) ;; *) [ "${#COMPREPLY[@]}" -eq 0 ] && COMPREPLY=($(compgen -f -- "$current"));; esac',
        "}",
        "complete -F _superfluid superfluid",
        "",
    ]
    return "\n".join(lines)


def _fish(table: dict[str, list[str]], commands: list[str], verbs: dict[str, list[str]]) -> str:
    lines = ["# superfluid completion (superfluid completion fish)"]
    lines.append(f"complete -c superfluid -n __fish_use_subcommand -a '{' '.join(commands)}'")
    for name in commands:
        seen = f"__fish_seen_subcommand_from {name}"
        if verbs[name]:
            lines.append(f"complete -c superfluid -n '{seen}' -a '{' '.join(verbs[name])}'")
            for verb in verbs[name]:
                lines += _fish_words(f"{seen}; and __fish_seen_subcommand_from {verb}", table[f"{name} {verb}"])
        else:
            lines += _fish_words(seen, table[name])
    return "\n".join(lines) + "\n"


def _fish_words(condition: str, words: list[str]) -> list[str]:
    flags = [f"complete -c superfluid -n '{condition}' -l {word[2:]}" for word in words if word.startswith("--")]
    values = [word for word in words if not word.startswith("--")]
    return flags + ([f"complete -c superfluid -n '{condition}' -a '{' '.join(values)}'"] if values else [])
