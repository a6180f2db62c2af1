"""`specdec serve`: an OpenAI-compatible HTTP server over the batched runtime.

A thin layer: `specdec.openai_api` turns request bodies into GenerationConfigs (or 400s), `scheduler` runs the one
BatchedEngine on a worker thread with continuous refill, `app` is the Starlette application. Nothing here is
imported by `import specdec`: the web stack is loaded only by `specdec serve` (or `create_app`).
"""
