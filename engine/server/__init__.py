"""An OpenAI-compatible HTTP server on a running Engine (`folio serve`).

`app.py`: the Starlette app, `serve` and `Server`; `schemas.py`: request bodies into
`JobRequest`s; `responses.py`: the response objects; `streaming.py`: events between the
engine thread and the event loop, server-sent events, cancel on disconnect; `metrics.py`:
GET /metrics; `errors.py`: OpenAI error objects; `tag.py`: the tag API jobs carry;
`cli.py`: the `folio serve` command.
"""
