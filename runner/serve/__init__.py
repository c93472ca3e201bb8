"""`ggrun serve`: an OpenAI- and Ollama-compatible HTTP server on top of the engine (it never
reaches into kernels or model code).

- server.py: the socket, uvicorn, and a clean stop on Ctrl-C or SIGTERM;
- app.py: the Starlette routes, the API key, errors, health, props, metrics, tokenize;
- page.py: the chat page's files (webui/), served at / with a Content-Security-Policy;
- openai_api.py, ollama_api.py: the two APIs' endpoints;
- fields.py: a request's JSON checked (types, known fields, sampling options) and ApiError;
- model.py: the model's names and facts, and prompts into token ids that fit a sequence's context;
- replies.py: a ticket's events into a whole or streamed reply, cancelled when the client leaves;
- scheduler.py: the worker thread that owns the model, its queue and prefix reuse (the
  interface continuous batching will plug into);
- text.py: stop strings cut out of streamed text.
"""
