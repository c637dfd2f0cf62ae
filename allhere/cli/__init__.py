"""Command line: a table of commands (``main.COMMANDS``: name, help, its arguments, what it runs). Each
command validates its arguments while they are parsed (``args``), calls an experiment
(``allhere_recipes``) or the library, and prints the result."""

from .main import COMMANDS, Command, build_parser, main

__all__ = ["COMMANDS", "Command", "build_parser", "main"]
