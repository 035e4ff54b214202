"""The app's engine on another machine: an OpenAI-compatible server (another Folio, vLLM,
llama.cpp) driven over HTTP, its memory drawn from what it publishes (metrics, KV-cache
events, Folio's page-table snapshot). Qt-free, like the rest of `engine`."""
