"""The terminal front end: the `ggrun` command line and the chat REPL."""
