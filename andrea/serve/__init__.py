"""A trained model behind an HTTP API: `python -m andrea.serve RUN_OR_HF_DIR` (docs/serving.md).

    api.py       a completion request checked field by field into a `Completion` (OpenAI's legacy
                 completions API, for what a base model can honour), and the error every refusal is
    engine.py    the model's one thread: a bounded queue, requests stepped in turn token by token,
                 each sequence with its own key/value cache (andrea.sample.Decoder)
    app.py       the Starlette application: the routes, server-sent events, the page's assets
    cli.py       the command: load the model (andrea.eval.load_any), bind, run uvicorn
    page/        the page at `/`: a prompt, its completion streamed, any token traced (andrea.trace)

Only app.py and cli.py import the `serve` extra (starlette, uvicorn).
"""
