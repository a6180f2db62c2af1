"""`specdec serve`: the OpenAI-compatible HTTP server (specdec/server/), a thin layer over serve_bundle."""
from __future__ import annotations

from pathlib import Path

import click

from specdec.cli.common import build_config, friendly, parse_draft_len, runtime_options
from specdec.errors import SpecdecError


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default; another one needs --api-key to be safe).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-batch", default=4, show_default=True, type=click.IntRange(min=1),
              help="Requests generated at once (rows of the batched target; a finished row is refilled at once).")
@click.option("--queue", "queue_size", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests that may wait for a row; beyond that the server answers 429.")
@click.option("--api-key", default=None, envvar="SPECDEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (or set SPECDEC_API_KEY).")
@click.option("--drafter", type=click.Choice(["none", "ngram", "corpus", "model"]), default=None,
              help="The drafter every request uses (default: the bundle's).")
@click.option("--draft-len", callback=parse_draft_len, default="auto", show_default=True,
              help="Drafted tokens per round: K, 'auto' (one width per round for the whole batch), or 0.")
@click.option("--max-len", type=int, default=None, help="KV buffer length per row (default: the bundle's).")
@click.option("--threads", default=0, show_default=True, help="Intra-op threads (0 = all cores).")
@click.option("--provider", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu", show_default=True)
@click.option("--model-name", default=None, help="The model id clients see (default: the bundle folder's name).")
@friendly
def serve(bundle, host, port, max_batch, queue_size, api_key, drafter, draft_len, max_len, threads, provider,
          model_name):
    """Serve BUNDLE over HTTP: OpenAI's /v1/chat/completions and /v1/completions, a chat page at /."""
    try:
        from specdec.server.app import ServerOptions, serve_bundle
    except ImportError as e:
        raise SpecdecError(f"the server needs its extra ({e.name} is missing)",
                           "pip install 'specdec[serve]'") from None
    options = build_config(ServerOptions, model_name=model_name or Path(bundle).resolve().name, queue_size=queue_size,
                     api_key=api_key, draft_len=draft_len)
    serve_bundle(bundle, host, port, max_batch, options, max_len, drafter, runtime_options(provider, threads, bundle),
                 echo=lambda line: click.echo(line, err=True))


COMMANDS = [serve]
