from .terminal.cli import entry

entry()
