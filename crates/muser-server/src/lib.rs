//! muser-server: the HTTP edge of Muser. OpenAI-, llama.cpp- and Ollama-shaped routes over
//! the engine, strict JSON wire types, API-key auth, request and connection limits, the
//! listener (HTTP/1.1, optionally TLS) and Prometheus metrics.
//!
//! # Rules on every route
//! - One guard layer (`routes::guard`) runs first on every route: without an API key the
//!   `Host` must name this server (else **403**); every POST must be
//!   `Content-Type: application/json` (`charset=utf-8` allowed), whatever its body (else
//!   **415**); with `--api-key-file`/`MUSER_API_KEY`/`--api-key`, every route but `/health`
//!   needs `Authorization: Bearer KEY` or `x-api-key: KEY` (constant-time compare), else **401**; more than
//!   `limits::IN_FLIGHT_MAX` requests in flight is **503** with `Retry-After`.
//! - Bodies over 4 MiB are **413**; malformed JSON is **415**. Unknown fields (at any depth,
//!   named with their path), wrong types, bad ranges, token ids outside the vocabulary, and
//!   prompts that do not fit the per-slot context are **400** with the field or limit in the
//!   message; every bound is in `limits` (and `docs/security.md`), decided before the work.
//! - One model is served: the OpenAI and llama.cpp routes answer to any `model` name, as
//!   llama-server does; the Ollama routes answer to the model's id and `--alias` names (with
//!   a `:tag`) and give **404** `model_not_found` for others.
//! - A full engine queue is **429** with `Retry-After`. A client that disconnects (or leaves
//!   a write blocked for 30 s) cancels its generation (the engine receiver is dropped).
//! - `/health` is **503** once the engine has stopped; the server then exits non-zero.
//! - The dashboard's files (`/`, `/assets/*`) are open: they hold no data; everything they
//!   show comes from routes under the key.
//! - Errors are `{"error": {"type", "message", "code"}}`.
//!
//! # Routes and deviations
//! - `POST /v1/chat/completions`: messages (text and `image_url` parts: `data:` URIs with
//!   `--mmproj`, else 400; remote URLs 400, see `vision`), tools and tool_choice (passed to the
//!   template; `required` and a named function are **enforced** by grammar-constrained
//!   sampling: the output is one call to an offered tool, in ATEM for Muse models and as
//!   `{"name", "arguments"}` JSON for others), `response_format` `text`, `json_object` or
//!   `json_schema` (**enforced**: the content is one JSON object, or JSON following the
//!   schema; schemas with keywords beyond type/properties/required/items/enum/const/anyOf/
//!   oneOf are 400; see `structured`), stream with `stream_options.include_usage`, logprobs/top_logprobs (≤ 20), `n` = 1 only,
//!   seed, stop, max_tokens / max_completion_tokens, temperature, top_p, top_k, min_p,
//!   presence/frequency/repeat penalties, logit_bias. For Muse models the output goes through
//!   `MuseParser`: reasoning in `reasoning_content`, tool calls in `tool_calls`.
//! - `POST /v1/completions` (one prompt: text or token ids; `echo`, `suffix`, `best_of` > 1
//!   refused), `POST /v1/embeddings` (last-token pooling, L2-normalized; float or base64),
//!   `GET /v1/models`.
//! - llama.cpp: `POST /completion` (prompt as text, ids or a mix, or `{prompt_string,
//!   multimodal_data}` with `<__media__>` markers and `--mmproj`; n_predict, sampling fields,
//!   seed, stop, stream, cache_prompt, id_slot, n_probs, return_tokens, ignore_eos,
//!   logit_bias pairs, `json_schema` enforced like `response_format`; `timings` in the
//!   answer), `/tokenize`, `/detokenize`,
//!   `/apply-template`, `/embedding`, `GET /props`, `GET /slots`,
//!   `POST /slots/{id}?action=save|restore|erase` (files under `--slot-save-path`, names of
//!   `[A-Za-z0-9._-]` only), `GET /health`, `GET /metrics` (Prometheus text).
//! - Ollama: `POST /api/generate` and `/api/chat` (NDJSON streaming by default; `suffix` and
//!   `template` refused unless empty, `images` base64 with `--mmproj`, `format` `"json"` or a schema enforced
//!   like `response_format`, `keep_alive` ignored), `GET /api/tags`, `POST /api/show`, `GET /api/version`.
//! - Anthropic: `POST /v1/messages` (whole or streamed as Anthropic's events; tools, tool
//!   results, thinking history, base64 `image` blocks with `--mmproj`, `x-api-key`),
//!   `POST /v1/messages/count_tokens`. OpenAI
//!   Responses: `POST /v1/responses` and `/responses` (stateless). `POST /rerank` and
//!   `/v1/rerank` with `--rerank` (embedding similarity). Field by field: docs/compatibility.md.
//! - Muser: `/v1/sessions` (a slot's conversation and exact K/V as an encrypted bundle with
//!   revisions and idempotency keys; see `routes::sessions` and docs/sessions.md),
//!   `/v1/nodes` (a consumer's enrolled producers: list, enroll with a one-time code,
//!   remove; see `routes::nodes` and docs/nodes.md),
//!   `GET /v1/telemetry` and `GET /v1/telemetry/stream` (tagged measurements; see
//!   `routes::telemetry` and docs/telemetry.md), and the dashboard at `GET /`.
//!
//! # The prefill lane
//! A consumer (`lane`) may prefill long prompts on producers: the `timings` of every answer say
//! `prefill_lane` (`local` or `remote`) and `producer`, `/props` has `prefill_lane`. A producer
//! (`producer`) serves `POST /v1/prefill` and `GET /v1/lane/status` over mutual TLS instead of
//! these routes (docs/disaggregated-prefill.md).

pub mod auth;
pub mod chat;
pub mod cors;
pub mod enroll;
pub mod error;
pub mod gen;
pub mod http;
pub mod json;
pub mod kvkey;
pub mod lane;
pub mod limits;
pub mod metrics;
pub mod migrate;
pub mod onboard;
pub mod producer;
pub mod reqlog;
pub mod routes;
pub mod server;
pub mod slotfile;
pub mod state;
pub mod structured;
pub mod vision;
pub mod wire;
