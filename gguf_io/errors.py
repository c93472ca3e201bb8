"""The one exception type a user can cause by handing ggrun a bad or unsupported file."""


class GGUFError(Exception):
    """A GGUF file is malformed, truncated, or uses something ggrun does not support.

    The message is a single line meant for the user; the command line prints it and exits 1.
    """
