"""Text in and out of a model: tokenizer, pre-tokenizer, chat templates and their sandbox, reasoning
markup, and the text files a user names."""
