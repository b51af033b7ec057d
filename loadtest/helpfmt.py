"""The load tools' --help: every flag's help ends with its default (or says it is required)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's "(default: X)" after each flag's help, unless the help already gives it;
    "(default: off)" for switches, "(required)" for required flags. A flag whose default is
    None says in its help what happens without it, with its own "(default: ...)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)"
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return super()._get_help_string(action)
