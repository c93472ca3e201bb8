class ConversionError(Exception):
    """A checkpoint folder that cannot be converted: missing or corrupt files, unsupported contents."""
